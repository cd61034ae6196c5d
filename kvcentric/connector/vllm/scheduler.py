"""Scheduler side of the vLLM connector: lookups, and which pages to load and save.

Runs in vLLM's engine-core process. Per request it keeps the ``Request`` (tokens and
``cache_salt``), the chained block hashes computed so far, and a save tracker (the
request's block table and how many stored blocks are already saved).

- Lookup (``get_num_new_matched_tokens``): one batched ``batch_exists`` over the stored
  blocks beyond the engine's own prefix-cache hit, followed by the key of the prompt's
  *tail* (its partial last block), so an exact repeat hits up to ``num_tokens - 1``: vLLM
  computes one token (docs/architecture.md §2.3). Loads are synchronous and layer-wise
  inside the same step, so the answer is ``(tokens, False)``. It is side-effect free
  apart from an overwritable note of the last answer (vLLM may ask again).
- Loads (``update_state_after_alloc``): the engine pages of the matched blocks and tail,
  up to the page holding the hit's last token (a last block may be loaded in part).
- Saves (``build_connector_meta``): every stored block that becomes full in this step,
  including blocks completed over several chunked-prefill steps, and (``save_decode``)
  blocks of generated tokens; a tail at the end of the prefill and (``save_decode``) at
  the step that produces the request's last token (``max_tokens``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvcentric.connector.vllm.counters import Counters
from kvcentric.connector.vllm.engine_layout import EngineLayout
from kvcentric.connector.vllm.metadata import KVCentricMetadata, TransferSpec
from kvcentric.connector.vllm.mover import SKIP
from kvcentric.connector.vllm.settings import ConnectorSettings
from kvcentric.hashing import block_hashes, hash_seed, prompt_tail
from kvcentric.store import KVStore, StoreUnavailable

log = logging.getLogger("kvcentric.connector")


@dataclass
class _Lookup:
    num_computed: int  # engine's own hit, tokens
    first_block: int  # first stored block to load
    num_blocks: int  # full stored blocks present from first_block on
    tail_key: str | None = None  # a tail object present after them


@dataclass
class _Tracker:
    block_ids: list[int]
    saved_blocks: int = 0
    tail_end: int = 0  # tokens covered by the last tail saved (0: none yet)


@dataclass
class _ReqState:
    request: Any
    hashes: list[bytes] = field(default_factory=list)
    tracker: _Tracker | None = None
    loaded: _Tracker | None = None  # what this step loads from the store (not re-saved)


class KVCentricScheduler:
    """Decides loads and saves; talks to the store only through ``batch_exists``."""

    def __init__(self, settings: ConnectorSettings, layout: EngineLayout, store: KVStore,
                 loads: bool, saves: bool) -> None:
        self.settings = settings
        self.layout = layout
        self.store = store
        self.loads_enabled = loads
        self.saves_enabled = saves
        self.stats = Counters()
        self._reqs: dict[str, _ReqState] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._pending_loads: list[TransferSpec] = []

    # ---- hashes ----
    def _state(self, request: Any) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = self._reqs[request.request_id] = _ReqState(request)
        return st

    def _hashes(self, st: _ReqState, num_blocks: int) -> list[bytes]:
        """Chained hashes of the first ``num_blocks`` stored blocks of the request's tokens."""
        have = len(st.hashes)
        if num_blocks > have:
            s = self.layout.stored_block_size
            toks = st.request.all_token_ids[have * s : num_blocks * s]
            seed = hash_seed(self.layout.keyspace.model_id, st.request.cache_salt)
            st.hashes.extend(block_hashes(toks, s, seed,
                                          parent=st.hashes[-1] if st.hashes else None))
        return st.hashes[:num_blocks]

    def _tail(self, st: _ReqState, end: int) -> tuple[str, int] | None:
        """Key and token count of the tail of the request's first ``end`` tokens
        (:func:`kvcentric.hashing.prompt_tail`)."""
        s = self.layout.stored_block_size
        seed = hash_seed(self.layout.keyspace.model_id, st.request.cache_salt)
        tail = prompt_tail(st.request.all_token_ids[:end], s, seed, self._hashes(st, end // s))
        return None if tail is None else (self.layout.keyspace.tail_key(tail), tail.count)

    # ---- lookup and loads ----
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` loadable from the store (sync load)."""
        self._lookups.pop(request.request_id, None)
        if not self.loads_enabled:
            return 0, False
        s, n = self.layout.stored_block_size, request.num_tokens
        full, first = n // s, num_computed_tokens // s
        st = self._state(request)
        tail = self._tail(st, n)
        keys = self.layout.keyspace.keys(self._hashes(st, full)[first:])
        if tail is not None:
            keys.append(tail[0])  # after the blocks: present only if they all are
        if not keys:
            return 0, False
        t0 = time.perf_counter()
        try:
            run = self.store.batch_exists(keys)
        except StoreUnavailable:
            run = 0
        self.stats.add(lookups=1, lookup_seconds=time.perf_counter() - t0)
        blocks = min(run, full - first)
        tail_key, tail_tokens = tail if tail is not None and run == len(keys) else (None, 0)
        # never the whole prompt: vLLM must compute at least the last token
        end = min((first + blocks) * s + tail_tokens, n - 1)
        if end <= num_computed_tokens:
            return 0, False
        self._lookups[request.request_id] = _Lookup(num_computed_tokens, first, blocks,
                                                    tail_key)
        return end - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the last lookup's objects into the just-allocated pages: every
        page holding a token of ``[num_computed, num_computed + num_external_tokens)``."""
        lk = self._lookups.pop(request.request_id, None)
        if num_external_tokens <= 0 or lk is None:
            return
        s, page = self.layout.stored_block_size, self.layout.page_size
        end = lk.num_computed + num_external_tokens
        num_objects = -(-end // s) - lk.first_block
        st = self._state(request)
        last = lk.first_block + min(num_objects, lk.num_blocks)
        keys = self.layout.keyspace.keys(self._hashes(st, last)[lk.first_block:])
        if num_objects > lk.num_blocks:
            assert lk.tail_key is not None and num_objects == lk.num_blocks + 1
            keys.append(lk.tail_key)
        pages = self._pages(blocks.get_block_ids()[0], lk.first_block, len(keys),
                            lk.num_computed // page, -(-end // page))
        self._pending_loads.append(TransferSpec(request.request_id, keys, pages))
        tail_loaded = num_objects > lk.num_blocks
        if lk.first_block == 0:  # the store holds these: saving them again costs a reserve
            st.loaded = _Tracker([], saved_blocks=min(num_objects, lk.num_blocks),
                                 tail_end=request.num_tokens if tail_loaded else 0)
        self.stats.add(hit_tokens=num_external_tokens, tail_hits=int(tail_loaded))

    def _pages(self, page_table: list[int], first_object: int, num_objects: int,
               first_page: int, end_page: int) -> list[list[int]]:
        """Per object from ``first_object`` on, its ``k`` engine pages; pages outside
        ``[first_page, end_page)`` (the engine's own hit, or past the tokens moved) are
        ``SKIP``."""
        k = self.layout.pages_per_object
        return [[page_table[i] if first_page <= i < min(end_page, len(page_table)) else SKIP
                 for i in range(b * k, (b + 1) * k)]
                for b in range(first_object, first_object + num_objects)]

    # ---- saves ----
    def build_connector_meta(self, so: Any) -> KVCentricMetadata:
        """This step's loads and the saves of every stored block it completes."""
        meta = KVCentricMetadata(loads=self._pending_loads)
        self._pending_loads = []
        for req_id in so.preempted_req_ids or ():
            if req_id in self._reqs:
                self._reqs[req_id].tracker = None  # its pages are freed; resumes re-create it
        if not self.saves_enabled:
            return meta
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            done = st.loaded or _Tracker([])
            st.tracker = _Tracker(list(new.block_ids[0]), done.saved_blocks, done.tail_end)
            st.loaded = None
            self._plan_save(st, new.num_computed_tokens + so.num_scheduled_tokens[new.req_id],
                            meta)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids or st.tracker is None:
                st.tracker = _Tracker(list(new_ids[0]) if new_ids else [])
            elif new_ids:
                st.tracker.block_ids.extend(new_ids[0])
            self._plan_save(st, cached.num_computed_tokens[i] + so.num_scheduled_tokens[req_id],
                            meta)
        return meta

    def _plan_save(self, st: _ReqState, computed_after: int, meta: KVCentricMetadata) -> None:
        tr = st.tracker
        assert tr is not None
        planned = len(meta.saves)
        self._plan_blocks(st, computed_after, meta)
        self._plan_tail(st, computed_after, meta)
        req = st.request
        if (len(meta.saves) > planned and computed_after >= req.num_prompt_tokens
                and req.num_output_tokens + 1 >= req.max_tokens):
            meta.commit_now = True  # its response may complete with this step

    def _plan_blocks(self, st: _ReqState, computed_after: int, meta: KVCentricMetadata) -> None:
        tr = st.tracker
        assert tr is not None
        limit = computed_after if self.settings.save_decode else min(
            computed_after, st.request.num_prompt_tokens)
        s, k = self.layout.stored_block_size, self.layout.pages_per_object
        full = min(limit // s, len(tr.block_ids) // k)
        if full > tr.saved_blocks:
            keys = self.layout.keyspace.keys(self._hashes(st, full))
            first = tr.saved_blocks
            meta.saves.append(TransferSpec(
                st.request.request_id, keys[first:],
                [tr.block_ids[b * k:(b + 1) * k] for b in range(first, full)],
                [keys[b - 1] if b else None for b in range(first, full)]))
            tr.saved_blocks = full

    def _plan_tail(self, st: _ReqState, computed_after: int, meta: KVCentricMetadata) -> None:
        """Save the tail when this step ends the prefill, and (``save_decode``) when it
        produces the request's last token; one tail per request end."""
        req, tr = st.request, st.tracker
        assert tr is not None
        end = 0
        if (self.settings.save_decode and computed_after >= req.num_prompt_tokens
                and req.num_output_tokens + 1 >= req.max_tokens):
            end = computed_after
        elif computed_after >= req.num_prompt_tokens:
            end = req.num_prompt_tokens
        tail = self._tail(st, end) if end > tr.tail_end else None
        if tail is None:
            return
        s, page = self.layout.stored_block_size, self.layout.page_size
        block = end // s
        if -(-end // page) > len(tr.block_ids):
            return  # its pages are not all allocated (cannot happen after a real step)
        parents: list[str | None] = [None]
        if block:
            parents = [self.layout.keyspace.key(self._hashes(st, block)[-1])]
        meta.saves.append(TransferSpec(
            req.request_id, [tail[0]],
            self._pages(tr.block_ids, block, 1, block * s // page, -(-end // page)),
            parents))
        tr.tail_end = end
        self.stats.add(saved_tails=1)

    def register_request(self, request: Any) -> None:
        """Remember a new request (its tokens are needed to key its saves)."""
        self._state(request)

    def request_finished(self, request: Any) -> None:
        self._reqs.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
