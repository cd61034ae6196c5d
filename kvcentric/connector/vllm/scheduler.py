"""Scheduler side of the vLLM connector: lookups, and which pages to load and save.

Runs in vLLM's engine-core process. Per request it keeps the ``Request`` (tokens and
``cache_salt``), the chained block hashes computed so far, and a save tracker (the
request's block table and how many stored blocks are already saved).

- Lookup (``get_num_new_matched_tokens``): one batched ``batch_exists`` over the stored
  blocks beyond the engine's own prefix-cache hit; loads are synchronous and layer-wise
  inside the same step, so the answer is ``(tokens, False)``. It is side-effect free
  apart from an overwritable note of the last answer (vLLM may ask again).
- Loads (``update_state_after_alloc``): the matched blocks' engine pages.
- Saves (``build_connector_meta``): every stored block that becomes full in this step,
  including blocks completed over several chunked-prefill steps, and (``save_decode``)
  blocks of generated tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvcentric.connector.vllm.engine_layout import EngineLayout
from kvcentric.connector.vllm.metadata import KVCentricMetadata, TransferSpec
from kvcentric.connector.vllm.mover import SKIP
from kvcentric.connector.vllm.settings import ConnectorSettings
from kvcentric.connector.vllm.stats import KVCentricStats
from kvcentric.hashing import block_hashes, hash_seed
from kvcentric.store import KVStore, StoreUnavailable

log = logging.getLogger("kvcentric.connector")


@dataclass
class _Lookup:
    num_computed: int  # engine's own hit, tokens
    first_block: int  # first stored block to load
    num_blocks: int


@dataclass
class _Tracker:
    block_ids: list[int]
    saved_blocks: int = 0


@dataclass
class _ReqState:
    request: Any
    hashes: list[bytes] = field(default_factory=list)
    tracker: _Tracker | None = None


class KVCentricScheduler:
    """Decides loads and saves; talks to the store only through ``batch_exists``."""

    def __init__(self, settings: ConnectorSettings, layout: EngineLayout, store: KVStore,
                 loads: bool, saves: bool) -> None:
        self.settings = settings
        self.layout = layout
        self.store = store
        self.loads_enabled = loads
        self.saves_enabled = saves
        self.stats = KVCentricStats()
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

    # ---- lookup and loads ----
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` loadable from the store (sync load)."""
        self._lookups.pop(request.request_id, None)
        if not self.loads_enabled:
            return 0, False
        s = self.layout.stored_block_size
        # never the whole prompt: vLLM must compute at least the last token
        max_blocks = (request.num_tokens - 1) // s
        first = num_computed_tokens // s
        if max_blocks <= first:
            return 0, False
        st = self._state(request)
        keys = self.layout.keyspace.keys(self._hashes(st, max_blocks)[first:])
        t0 = time.perf_counter()
        try:
            run = self.store.batch_exists(keys)
        except StoreUnavailable:
            run = 0
        self.stats.add(lookups=1, lookup_seconds=time.perf_counter() - t0)
        if run == 0:
            return 0, False
        self._lookups[request.request_id] = _Lookup(num_computed_tokens, first, run)
        return (first + run) * s - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the last lookup's blocks into the just-allocated pages."""
        lk = self._lookups.pop(request.request_id, None)
        if num_external_tokens <= 0 or lk is None:
            return
        s, k, page = self.layout.stored_block_size, self.layout.pages_per_object, \
            self.layout.page_size
        n = (lk.num_computed + num_external_tokens) // s - lk.first_block
        page_table = blocks.get_block_ids()[0]
        first_page = lk.num_computed // page  # pages before it are the engine's own hit
        page_ids = []
        for b in range(lk.first_block, lk.first_block + n):
            page_ids.append([p_id if b * k + j >= first_page else SKIP
                             for j, p_id in enumerate(page_table[b * k:(b + 1) * k])])
        st = self._state(request)
        keys = self.layout.keyspace.keys(self._hashes(st, lk.first_block + n)[lk.first_block:])
        self._pending_loads.append(TransferSpec(request.request_id, keys, page_ids))
        self.stats.add(hit_tokens=num_external_tokens)

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
            st.tracker = _Tracker(list(new.block_ids[0]))
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
        limit = computed_after if self.settings.save_decode else min(
            computed_after, st.request.num_prompt_tokens)
        s, k = self.layout.stored_block_size, self.layout.pages_per_object
        full = min(limit // s, len(tr.block_ids) // k)
        if full <= tr.saved_blocks:
            return
        keys = self.layout.keyspace.keys(self._hashes(st, full))
        first = tr.saved_blocks
        meta.saves.append(TransferSpec(
            st.request.request_id, keys[first:],
            [tr.block_ids[b * k:(b + 1) * k] for b in range(first, full)],
            [keys[b - 1] if b else None for b in range(first, full)]))
        tr.saved_blocks = full

    def register_request(self, request: Any) -> None:
        """Remember a new request (its tokens are needed to key its saves)."""
        self._state(request)

    def request_finished(self, request: Any) -> None:
        self._reqs.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
