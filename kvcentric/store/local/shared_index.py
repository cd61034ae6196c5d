"""The local store's shared-memory lookup index: ``batch_exists`` without a round trip.

The coordinator publishes every committed object in a hash table in a file next to the
arena (tmpfs); clients map it read-only and answer leading-run lookups themselves, so
lookups from many engines, workers and the router scale with their processes instead of
queueing on the coordinator's one thread (docs/store.md §Shared-memory lookups). Only lookups use
it: leases, reads and writes still go through the coordinator, which stays the one
authority (a lookup's answer is a hint; ``acquire`` re-checks every key exactly).

File layout (little-endian u64 words)::

    header [8]: magic, version, seq, nslots, enabled, live, heartbeat, reserved
    slots  [nslots, 3]: fingerprint, meta, parent fingerprint

``fingerprint`` = xxh3_64 of the key's UTF-8 bytes with the low bit set (0 = empty
slot); ``meta`` = ``depth << 2 | complete << 1 | 1``, where ``depth`` counts an object's
linked ancestors and ``complete`` says all of them are committed (a chain with no hole
back to a root stored without parent). Linear probing with backward-shift deletion (no
tombstones). ``heartbeat`` is the coordinator's ``time.monotonic()`` in ms, written every
loop turn: a reader does not trust an index whose coordinator stopped beating (killed).
``seq`` is a seqlock: odd while the coordinator writes; a reader retries when
it changed during its read. This relies on x86-64's store and load ordering (TSO), so
readers on other architectures fall back to the socket.

Leading run of a chain ``k[0..n)`` (each key's parent is the one before it, as the
connectors and the router build them; ``k[0]`` at any depth ``d``): ``P(i)`` = ``k[i]``
is committed, complete, at depth ``d + i``, with parent ``k[i-1]``. ``P`` is monotone on
a chain, so a binary search finds its first false ``i`` in log2(n) probes; a linear scan
of plain presence continues from there, which makes the answer exact also for keys stored
without parents or whose parents are missing. A list that is not a chain but links
stored parent/child pairs may be overcounted; ``acquire`` is exact, so the connector
then loads less than it was told and recomputes the rest (docs/store.md §Shared-memory lookups).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import xxhash

from kvcentric.store.local import trust

MAGIC = 0x6B76_6378_6964_7831  # "kvcxidx1"
VERSION = 1
HEADER_WORDS = 8
SEQ, NSLOTS, ENABLED, LIVE, HEARTBEAT = 2, 3, 4, 5, 6
STALE_AFTER_MS = 3000  # the coordinator beats at least once a second while it runs
SLOT_WORDS = 3
MAX_LOAD = 0.5  # above this many live slots per slot, lookups go back to the socket
READ_RETRIES = 8


def fingerprint(key: str) -> int:
    """The 64-bit table fingerprint of ``key``; never 0 (0 marks an empty slot)."""
    return xxhash.xxh3_64_intdigest(key.encode()) | 1


def slots_for(capacity_bytes: int) -> int:
    """Table size for an arena: room for one object per 16 KiB at half load, a power of
    two in [4096, 4M] (4M slots = 96 MiB of shared memory)."""
    want = max(4096, 2 * capacity_bytes // (16 << 10))
    return min(1 << 22, 1 << (want - 1).bit_length())


def meta_word(depth: int, complete: bool) -> int:
    return depth << 2 | int(complete) << 1 | 1


def _map(fd: int, nbytes: int, writable: bool) -> tuple[mmap.mmap, memoryview]:
    """Map ``nbytes`` of ``fd`` (which the caller opened and closes)."""
    mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED,
                   mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    return mm, memoryview(mm).cast("Q")


class SharedIndexWriter:
    """The coordinator's side: creates the file (allocated whole: ``OSError`` when the
    file system has no room) and keeps it equal to the committed set.

    Single-threaded (the coordinator's loop). Mutations must happen inside ``write()``,
    which holds the seqlock odd; nested sections are one section.
    """

    def __init__(self, path: Path, nslots: int, gid: int | None = None) -> None:
        if nslots & (nslots - 1) or nslots < 16:
            raise ValueError("nslots must be a power of two >= 16")
        self.path = path
        self.nslots = nslots
        self._mask = nslots - 1
        nbytes = 8 * (HEADER_WORDS + SLOT_WORDS * nslots)
        # a new file (O_EXCL): a planted file or symlink is never written through; readable
        # by a peer_group (gid) when there is one
        fd = trust.open_file(path, os.O_RDWR, "store lookup index", new=True,
                             mode=0o600 if gid is None else 0o640, gid=gid)
        try:
            # allocated now: a write into a hole of a full tmpfs would be a SIGBUS later
            os.posix_fallocate(fd, 0, nbytes)
            self._mm, self._w = _map(fd, nbytes, writable=True)
        finally:
            os.close(fd)
        w = self._w
        w[0], w[1], w[SEQ], w[NSLOTS], w[ENABLED], w[LIVE] = MAGIC, VERSION, 0, nslots, 1, 0
        self._depth = 0
        self.disabled_reason = ""
        self.beat()

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        """A write section: readers that overlap it retry or fall back to the socket."""
        self._depth += 1
        if self._depth == 1:
            self._w[SEQ] += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._w[SEQ] += 1

    def _find(self, fp: int) -> int:
        """Slot index holding ``fp``, or of the empty slot where it would go."""
        w, i = self._w, fp & self._mask
        while True:
            at = HEADER_WORDS + SLOT_WORDS * i
            if w[at] == 0 or w[at] == fp:
                return i
            i = (i + 1) & self._mask

    def put(self, key: str, depth: int, complete: bool, parent: str | None) -> None:
        """Publish (or update) a committed object."""
        assert self._depth, "put outside a write section"
        if not self._w[ENABLED]:
            return
        fp = fingerprint(key)
        at = HEADER_WORDS + SLOT_WORDS * self._find(fp)
        w = self._w
        if w[at] == 0:
            if (w[LIVE] + 1) > MAX_LOAD * self.nslots:
                self.disable(f"more than {int(MAX_LOAD * self.nslots)} objects")
                return
            w[LIVE] += 1
        w[at + 1] = meta_word(depth, complete)
        w[at + 2] = fingerprint(parent) if parent else 0
        w[at] = fp

    def delete(self, key: str) -> None:
        """Unpublish ``key`` (backward-shift deletion keeps every probe run unbroken)."""
        assert self._depth, "delete outside a write section"
        if not self._w[ENABLED]:
            return
        w, mask = self._w, self._mask
        i = self._find(fingerprint(key))
        if w[HEADER_WORDS + SLOT_WORDS * i] == 0:
            return
        w[LIVE] -= 1
        j = i
        while True:
            j = (j + 1) & mask
            at_j = HEADER_WORDS + SLOT_WORDS * j
            fp = w[at_j]
            if fp == 0:
                break
            home = fp & mask
            # move j back into the hole at i unless its home lies cyclically in (i, j]
            if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
                at_i = HEADER_WORDS + SLOT_WORDS * i
                w[at_i + 1], w[at_i + 2], w[at_i] = w[at_j + 1], w[at_j + 2], fp
                i = j
        w[HEADER_WORDS + SLOT_WORDS * i] = 0

    def clear(self) -> None:
        assert self._depth, "clear outside a write section"
        words = SLOT_WORDS * self.nslots
        self._w[HEADER_WORDS:HEADER_WORDS + words] = memoryview(bytes(8 * words)).cast("Q")
        self._w[LIVE] = 0

    def disable(self, why: str) -> None:
        """Send every reader back to the socket for good (e.g. the table is full)."""
        self._w[ENABLED] = 0
        self.disabled_reason = why

    def beat(self) -> None:
        """Tell readers the coordinator is alive (call at least once a second)."""
        self._w[HEARTBEAT] = int(time.monotonic() * 1000)

    @property
    def enabled(self) -> bool:
        return bool(self._w[ENABLED])

    def close(self) -> None:
        self._w.release()
        self._mm.close()


class SharedIndexReader:
    """A client's read-only view; ``leading_run`` returns None when the caller must ask
    the coordinator instead (writer busy for too long, index disabled, not x86-64)."""

    def __init__(self, path: Path, owner: int | None = None) -> None:
        """Map ``path``, a regular file of ``owner`` (default: us) reached through no
        symlink (``Untrusted`` otherwise); ``ValueError`` when it is not a whole index."""
        fd = trust.open_file(path, os.O_RDONLY, "store lookup index", owner=owner)
        try:
            size = os.fstat(fd).st_size
            if size < 8 * HEADER_WORDS:
                raise ValueError(f"{path} is too small for a kvcentric shared index")
            self._mm, self._r = _map(fd, size, writable=False)
        finally:
            os.close(fd)
        r = self._r
        if r[0] != MAGIC or r[1] != VERSION:
            self.close()
            raise ValueError(f"{path} is not a kvcentric shared index (version {VERSION})")
        n = r[NSLOTS]
        if n < 16 or n & (n - 1) or size != 8 * (HEADER_WORDS + SLOT_WORDS * n):
            self.close()
            raise ValueError(f"{path} has the wrong size for its {n} slots")
        self._mask = r[NSLOTS] - 1
        self.usable = platform.machine().lower() in ("x86_64", "amd64")

    def _probe(self, fp: int) -> int:
        """Offset of ``fp``'s slot, or -1 when absent."""
        r, i = self._r, fp & self._mask
        while True:
            at = HEADER_WORDS + SLOT_WORDS * i
            got = r[at]
            if got == fp:
                return at
            if got == 0:
                return -1
            i = (i + 1) & self._mask

    def _linked(self, keys: Sequence[str], i: int, base: int) -> bool:
        """P(i): ``keys[i]`` committed, complete, at depth ``base + i``, child of
        ``keys[i-1]``."""
        at = self._probe(fingerprint(keys[i]))
        if at < 0:
            return False
        meta = self._r[at + 1]
        if meta & 2 == 0 or meta >> 2 != base + i:
            return False
        return i == 0 or self._r[at + 2] == fingerprint(keys[i - 1])

    def _search(self, keys: Sequence[str]) -> int:
        at = self._probe(fingerprint(keys[0])) if keys else -1
        if at < 0:
            return 0
        base = self._r[at + 1] >> 2  # a chain may start mid-way (the router's suffix)
        lo, hi = 1, len(keys)  # invariant: P true below lo, false at hi (or hi == len)
        while lo < hi and self._r[at + 1] & 2:
            mid = (lo + hi) // 2
            if self._linked(keys, mid, base):
                lo = mid + 1
            else:
                hi = mid
        n = lo
        while n < len(keys) and self._probe(fingerprint(keys[n])) >= 0:
            n += 1
        return n

    def leading_run(self, keys: Sequence[str]) -> int | None:
        """How many leading ``keys`` are committed, or None (ask the coordinator)."""
        r = self._r
        if not self.usable:
            return None
        for _ in range(READ_RETRIES):
            seq = r[SEQ]
            if seq & 1:
                os.sched_yield()  # the coordinator is mid-write; let it finish
                continue
            if not r[ENABLED] or time.monotonic() * 1000 - r[HEARTBEAT] > STALE_AFTER_MS:
                return None
            n = self._search(keys)
            if r[SEQ] == seq:
                return n
        return None

    def close(self) -> None:
        self._r.release()
        self._mm.close()
