"""Scheduler side of the vLLM connector: lookups, and which pages to load and save.

Runs in vLLM's engine-core process. Per request it keeps the ``Request`` (tokens,
``cache_salt``, LoRA, multimodal inputs, prompt embeddings), the chained block hashes
computed so far, and a save tracker (the request's block table and how many stored
blocks are already saved).

- Keys (:class:`~kvcentric.integrity.ObjectRef`): a block's chain hash folds in
  everything vLLM's own prefix cache hashes besides token ids
  (:mod:`kvcentric.connector.vllm.extra_keys`); a request whose inputs cannot be keyed
  is neither loaded nor saved (counted, logged once). Workers key each object in their
  own rank's key space.
- Lookup (``get_num_new_matched_tokens``): one batched ``batch_exists`` per TP rank over
  the stored blocks beyond the engine's own prefix-cache hit, followed by the key of the
  prompt's *tail* (its partial last block), so an exact repeat hits up to
  ``num_tokens - 1``: vLLM computes one token (docs/connector.md §Scheduler side). A block counts
  only when every rank's shard of it is stored. Loads are synchronous and layer-wise
  inside the same step, so the answer is ``(tokens, False)``. It is side-effect free
  apart from an overwritable note of the last answer (vLLM may ask again).
- Loads (``update_state_after_alloc``): the engine pages of the matched blocks and tail,
  up to the page holding the hit's last token (a last block may be loaded in part).
- Keys: each request's :class:`~kvcentric.connector.vllm.request_keys.RequestKeys`.
- Saves (``build_connector_meta``, :mod:`kvcentric.connector.vllm.save_plan`): every
  stored block that becomes full in this step, including blocks completed over several
  chunked-prefill steps, and (``save_decode``) blocks of generated tokens; a tail at the
  end of the prefill and (``save_decode``) at the step that produces the request's last
  token (``max_tokens``).
- Hybrid models (several KV cache groups, :mod:`kvcentric.connector.vllm.groups`): each
  layer's pages come from its own group's block table; a sliding-window group loads only
  the pages of the window before the hit's end. A recurrent group's state is saved at
  every step that ends on a stored-block boundary and a hit must end on a stored state
  (no tails). Their loads are asynchronous (``(tokens, True)``): vLLM takes a failed load
  of a multi-group model only as a failed request, which it recomputes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from kvcentric.connector.vllm.counters import Counters
from kvcentric.connector.vllm.engine_layout import EngineLayout
from kvcentric.connector.vllm.extra_keys import ExtraKeys, Unkeyable
from kvcentric.connector.vllm.metadata import KVCentricMetadata, TransferSpec
from kvcentric.connector.vllm.request_keys import RequestKeys
from kvcentric.connector.vllm.save_plan import ReqState, SavePlanner, SaveTracker
from kvcentric.connector.vllm.settings import ConnectorSettings
from kvcentric.connector.vllm.transfers import SKIP, object_pages
from kvcentric.integrity import ObjectRef
from kvcentric.store import KVStore, StoreUnavailable

log = logging.getLogger("kvcentric.connector")


@dataclass
class _Lookup:
    num_computed: int  # engine's own hit, tokens
    first_block: int  # first stored block to load
    num_blocks: int  # full stored blocks present from first_block on
    tail: ObjectRef | None = None  # a tail object present after them
    state: ObjectRef | None = None  # the recurrent state at the hit's end (hybrids)


class KVCentricScheduler:
    """Decides loads and saves (a :class:`SavePlanner` plans the saves); talks to the
    store only through ``batch_exists``."""

    def __init__(self, settings: ConnectorSettings, layout: EngineLayout, store: KVStore,
                 loads: bool, saves: bool) -> None:
        self.settings = settings
        self.layout = layout
        self.store = store
        self.loads_enabled = loads
        self.stats = Counters()
        self._reqs: dict[str, ReqState] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._pending_loads: list[TransferSpec] = []
        self._pending_states: list[TransferSpec] = []
        self._extra_keys = ExtraKeys()
        self._warned_unkeyable = False
        self.saves = SavePlanner(settings, layout, self.stats, self._reqs, saves,
                                 self._unkeyable)

    # ---- requests and their keys ----
    def _state(self, request: Any) -> ReqState:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = self._reqs[request.request_id] = ReqState(
                RequestKeys(request, self.layout, self._extra_keys))
        return st

    def _unkeyable(self, st: ReqState, exc: Unkeyable) -> None:
        st.unkeyable = True
        self.stats.add(unkeyed_requests=1)
        if not self._warned_unkeyable:
            self._warned_unkeyable = True
            log.warning("request %s: its KV depends on inputs kvcentric cannot key (%s); "
                        "such requests are neither loaded nor saved (counted as "
                        "kvcentric_unkeyed_requests)", st.request.request_id, exc)

    def object_refs(self, request: Any, num_tokens: int) -> list[ObjectRef]:
        """The stored objects of ``request``'s first ``num_tokens`` tokens: its full blocks,
        then its tail (inspection, tools and tests; ``Unkeyable`` when they have no key)."""
        return self._state(request).keys.objects(num_tokens)

    def _present(self, refs: list[ObjectRef]) -> int:
        """Leading ``refs`` stored for every TP rank (one ``batch_exists`` per rank)."""
        run = len(refs)
        for ks in self.layout.rank_keyspaces():
            if run == 0:
                break
            try:
                run = min(run, self.store.batch_exists([r.key(ks) for r in refs[:run]]))
            except StoreUnavailable:
                run = 0
        return run

    # ---- lookup and loads ----
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` loadable from the store (a sync load; an
        async one for hybrid models)."""
        self._lookups.pop(request.request_id, None)
        if not self.loads_enabled or not self.layout.servable:
            return 0, False
        s, n = self.layout.stored_block_size, request.num_tokens
        full, first = n // s, num_computed_tokens // s
        st = self._state(request)
        if st.async_load == request.num_preemptions and not st.load_failed:
            # looked up again without a preemption: vLLM sent it back after its
            # asynchronous load failed (a first block that failed leaves nothing
            # computed); a corrupt object would fail every retry, so it recomputes
            st.load_failed = True
            self.stats.add(failed_requests=1)
        if st.unkeyable or st.load_failed:
            return 0, False
        try:
            tail = st.keys.tail(n)
            refs = st.keys.blocks(first, full)
        except Unkeyable as exc:
            self._unkeyable(st, exc)
            return 0, False
        if tail is not None:
            refs.append(tail)  # after the blocks: present only if they all are
        if not refs:
            return 0, False
        t0 = time.perf_counter()
        run = self._present(refs)
        self.stats.add(lookups=1, lookup_seconds=time.perf_counter() - t0)
        blocks = min(run, full - first)
        tail_hit = tail if tail is not None and run == len(refs) else None
        # never the whole prompt: vLLM must compute at least the last token
        end = min((first + blocks) * s + (tail_hit.count if tail_hit else 0), n - 1)
        state = None
        if self.layout.state_geometry is not None:  # the hit ends where a state is stored
            end = end // s * s
            state = st.keys.state(end) if end > num_computed_tokens else None
            if state is None or self._present([state]) == 0:
                return 0, False
            blocks = end // s - first
        if end <= num_computed_tokens:
            return 0, False
        self._lookups[request.request_id] = _Lookup(num_computed_tokens, first, blocks,
                                                    tail_hit, state)
        return end - num_computed_tokens, self.layout.async_loads

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
        refs = st.keys.blocks(lk.first_block, last)  # hashed by the lookup: cannot raise
        if num_objects > lk.num_blocks:
            assert lk.tail is not None and num_objects == lk.num_blocks + 1
            refs.append(lk.tail)
        tables = blocks.get_block_ids()
        pages = self._load_pages(tables, lk.first_block, len(refs), lk.num_computed // page,
                                 -(-end // page), end)
        self._pending_loads.append(TransferSpec(request.request_id, refs, pages))
        if self.layout.async_loads:
            st.async_load = request.num_preemptions
        if lk.state is not None:
            groups = self.layout.groups
            assert groups is not None and end % self.layout.stored_block_size == 0
            # a page the state cannot go to (SKIP) fails the load: vLLM recomputes
            state_pages = groups.state_page(tables, end) or [SKIP] * len(groups.states)
            self._pending_states.append(TransferSpec(request.request_id, [lk.state],
                                                     [state_pages]))
        tail_loaded = num_objects > lk.num_blocks
        if lk.first_block == 0:  # the store holds these: saving them again costs a reserve
            st.loaded = SaveTracker([], saved_blocks=min(num_objects, lk.num_blocks),
                                 tail_end=request.num_tokens if tail_loaded else 0,
                                 state_end=end if lk.state is not None else 0)
        self.stats.add(hit_tokens=num_external_tokens, tail_hits=int(tail_loaded))

    def _load_pages(self, tables: Any, first_object: int, num_objects: int,
                    first_page: int, end_page: int, end: int) -> list[list[int]]:
        """The pages a load of ``num_objects`` objects from ``first_object`` on writes
        (:func:`~kvcentric.connector.vllm.transfers.object_pages`; per KV cache group for a
        hybrid model: ``GroupPlan.load_pages``, ``end`` the hit's tokens)."""
        groups = self.layout.groups
        if groups is None:
            return object_pages(tables[0], self.layout.pages_per_object, first_object,
                                num_objects, first_page, end_page)
        return groups.load_pages(tables, first_object, num_objects,
                                 self.layout.pages_per_object, first_page, end_page, end)

    # ---- saves (self.saves plans them) ----
    def build_connector_meta(self, so: Any) -> KVCentricMetadata:
        """This step's loads and the saves of every stored block it completes."""
        meta = KVCentricMetadata(loads=self._pending_loads, state_loads=self._pending_states)
        self._pending_loads, self._pending_states = [], []
        self.saves.plan_saves(so, meta)
        return meta

    def loads_failed(self, req_ids: Any) -> None:
        """Workers reported these requests' asynchronous loads failed (hybrid models):
        vLLM recomputes them from scratch; never look them up again (a corrupt object
        would fail every retry)."""
        for req_id in req_ids or ():
            if req_id in self._reqs:
                self._reqs[req_id].load_failed = True

    def register_request(self, request: Any) -> None:
        """Remember a new request (its tokens are needed to key its saves)."""
        self._state(request)

    def request_finished(self, request: Any) -> None:
        self._reqs.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
