"""An emulated engine's KV cache: ``capacity`` pages, a prefix cache over them, LRU eviction.

As vLLM's block pool: a page holds ``page_size`` tokens' KV. A request's pages are
allocated when it is admitted (its prompt) and as its output crosses page boundaries.
A page becomes *cached* (named by a chained hash of its tokens and everything before
them, with the cache salt in the root) once all of its tokens' KV is computed; a
``BlockStored`` event names it. A later request reuses the leading run of cached pages of
its prompt (at most ``n - 1`` tokens: the last prompt token is always computed). When a
request finishes its pages are freed; cached ones stay reusable in an LRU free list
(freed in reverse order, so a prompt's tail goes before its head), and are evicted
(``BlockRemoved``) only when an allocation needs their room. ``kv_usage`` is the share
of pages in use by requests, as vLLM's ``kv_cache_usage_perc``.

Page hashes are the last 8 bytes of :func:`kvcentric.hashing.block_hashes` over pages
with seed ``"emu|<salt>"``, as ints (vLLM publishes int hashes by default).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcentric.hashing import block_hashes, root_hash

from .events import AllBlocksCleared, removed, sglang_removed, sglang_stored, stored


def page_seed(salt: str | None) -> bytes:
    return f"emu|{salt or ''}".encode()


@dataclass
class SeqPages:
    """One request's pages: ``tokens`` known so far (prompt, then outputs), ``digests``
    of its full pages (chained), ``cached``: its leading pages that are in the cache and
    pinned by it, ``anon``: pages it holds that are not cached (yet)."""

    tokens: list[int]
    salt: str | None
    digests: list[bytes] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    anon: int = 0

    def hashes(self, page: int) -> list[int]:
        """Int hashes of every full page of ``tokens`` (extending the chain as needed)."""
        full = len(self.tokens) // page
        if len(self.digests) < full:
            k = len(self.digests)
            parent = self.digests[-1] if k else root_hash(page_seed(self.salt))
            self.digests += block_hashes(np.asarray(self.tokens[k * page:full * page],
                                                    dtype=np.uint32),
                                         page, b"", parent=parent)
        return [int.from_bytes(d[-8:], "big") for d in self.digests[:full]]

    @property
    def held(self) -> int:
        return len(self.cached) + self.anon


class PageCache:
    """The pages of one engine (single-threaded: the emulator's event loop)."""

    def __init__(self, capacity: int, page_size: int) -> None:
        if capacity < 1 or page_size < 1:
            raise ValueError("capacity and page_size must be >= 1")
        self.capacity, self.page_size = capacity, page_size
        self._refs: dict[int, int] = {}  # cached page hash -> requests using it
        self._free: OrderedDict[int, None] = OrderedDict()  # unused cached, oldest first
        self._anon = 0
        self.events: list[Any] = []  # this step's events, taken by the engine
        self.evicted = 0
        self.kind = "vllm"  # whose events: vLLM's (one per run of pages) or SGLang's

    # ---- state ----
    @property
    def used(self) -> int:
        """Pages holding KV: cached (in use or free) and not-yet-cached."""
        return len(self._refs) + self._anon

    @property
    def in_use(self) -> int:
        return self.used - len(self._free)

    @property
    def available(self) -> int:
        """Pages an allocation can get now (empty ones and evictable cached ones)."""
        return self.capacity - self.in_use

    @property
    def kv_usage(self) -> float:
        return self.in_use / self.capacity

    def cached_pages(self) -> int:
        return len(self._refs)

    def take_events(self) -> list[Any]:
        ev, self.events = self.events, []
        return ev

    # ---- requests ----
    def match(self, seq: SeqPages) -> int:
        """Leading pages of ``seq`` cached now, at most ``(len(tokens) - 1) // page``."""
        hashes = seq.hashes(self.page_size)
        limit = (len(seq.tokens) - 1) // self.page_size
        n = 0
        for h in hashes[:limit]:
            if h not in self._refs:
                break
            n += 1
        return n

    def admit(self, seq: SeqPages, hit_pages: int, total_tokens: int) -> bool:
        """Pin the first ``hit_pages`` cached pages and allocate the rest of
        ``total_tokens``' pages; False (nothing changed) when they do not fit."""
        need = -(-total_tokens // self.page_size) - hit_pages
        hashes = seq.hashes(self.page_size)[:hit_pages]
        reclaim = sum(1 for h in hashes if h in self._free)  # pinned: no longer evictable
        if need > self.available - reclaim:
            return False
        for h in hashes:
            self._pin(h)
        seq.cached = list(hashes)
        self._allocate(need)
        seq.anon += need
        return True

    def grow(self, seq: SeqPages, total_tokens: int) -> None:
        """Make ``seq`` hold the pages of ``total_tokens`` tokens (an output crossing a
        page boundary); beyond capacity it over-commits (vLLM would preempt)."""
        need = -(-total_tokens // self.page_size) - seq.held
        if need > 0:
            self._allocate(need)
            seq.anon += need

    def commit(self, seq: SeqPages, computed_tokens: int) -> None:
        """``seq``'s KV is computed up to ``computed_tokens``: cache its pages now full."""
        full = min(computed_tokens, len(seq.tokens)) // self.page_size
        start = len(seq.cached)
        if full <= start:
            return
        hashes = seq.hashes(self.page_size)
        run: list[int] = []
        run_start = start
        for i in range(start, full):
            h = hashes[i]
            if h in self._refs:  # computed twice (another request cached it meanwhile)
                self._flush(seq, hashes, run_start, run)
                run, run_start = [], i + 1
                self._pin(h)
                self._anon -= 1
            else:
                self._refs[h] = 1
                self._anon -= 1
                run.append(h)
            seq.anon -= 1
            seq.cached.append(h)
        self._flush(seq, hashes, run_start, run)

    def _flush(self, seq: SeqPages, hashes: list[int], start: int, run: list[int]) -> None:
        if not run:
            return
        p = self.page_size
        parent = hashes[start - 1] if start else None
        if self.kind == "sglang":  # one event per page, each with the request's salt
            for i, h in enumerate(run):
                first = (start + i) * p
                self.events.append(sglang_stored(h, parent, seq.tokens[first:first + p],
                                                 seq.salt))
                parent = h
            return
        self.events.append(stored(run, parent, seq.tokens[start * p:(start + len(run)) * p],
                                  p, seq.salt))

    def release(self, seq: SeqPages) -> None:
        """``seq`` is done: its cached pages become evictable (last page first), the rest
        are freed."""
        for h in reversed(seq.cached):
            n = self._refs.get(h)
            if n is None:
                continue
            if n <= 1:
                self._refs[h] = 0
                self._free[h] = None
            else:
                self._refs[h] = n - 1
        self._anon -= seq.anon
        seq.cached, seq.anon = [], 0

    def clear(self) -> bool:
        """vLLM's ``reset_prefix_cache``: drop every unused cached page; False (nothing
        done) while requests hold pages, as vLLM refuses then."""
        if self.in_use:
            return False
        self._refs.clear()
        self._free.clear()
        self.events.append(AllBlocksCleared())
        return True

    # ---- internals ----
    def _pin(self, h: int) -> None:
        n = self._refs[h]
        if n == 0:
            del self._free[h]
        self._refs[h] = n + 1

    def _allocate(self, n: int) -> None:
        """Take ``n`` pages, evicting the least recently freed cached pages for room."""
        while n > 0 and self.capacity - self.used < n and self._free:
            h, _ = self._free.popitem(last=False)
            del self._refs[h]
            self.events.append(sglang_removed(h) if self.kind == "sglang" else removed(h))
            self.evicted += 1
        self._anon += n
