"""Scheduler side of the vLLM connector: which stored objects each step saves.

:class:`SavePlanner` plans the saves of :class:`~kvcentric.connector.vllm.scheduler.
KVCentricScheduler`'s requests (their keys: each request's
:class:`~kvcentric.connector.vllm.request_keys.RequestKeys`). Per request a
:class:`SaveTracker` follows its block tables (one per KV cache group) and what is saved
already. Each step it plans:

- every stored block that becomes full in this step, including blocks completed over
  several chunked-prefill steps, and (``save_decode``) blocks of generated tokens, each
  with its parent's key; a hybrid model's block only when every attention group still
  holds its pages (a sliding window's older pages are the null block);
- a tail (the prompt's partial last block) at the end of the prefill and
  (``save_decode``) at the step that produces the request's last token;
- a hybrid model's recurrent state when the step ends on a stored-block boundary
  (mode ``align``: that block's state page holds it after the forward).

A request with saves in a step that may end it asks the workers to commit before the step
returns (``commit_now``): its response must not complete before its KV is stored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcentric.connector.vllm.counters import Counters
from kvcentric.connector.vllm.engine_layout import EngineLayout
from kvcentric.connector.vllm.extra_keys import Unkeyable
from kvcentric.connector.vllm.request_keys import RequestKeys
from kvcentric.connector.vllm.settings import ConnectorSettings
from kvcentric.connector.vllm.transfers import StepPlan, TransferSpec, object_pages
from kvcentric.integrity import ObjectRef


@dataclass
class SaveTracker:
    """What a running request has allocated and saved (dropped on preemption)."""

    tables: list[list[int]]  # the request's block ids, one list per KV cache group
    saved_blocks: int = 0
    tail_end: int = 0  # tokens covered by the last tail saved (0: none yet)
    state_end: int = 0  # tokens of the last recurrent state saved (0: none yet)


def block_tables(block_ids: Any) -> list[list[int]]:
    """vLLM's per-group block ids (a tuple of lists, or None) as lists we may extend."""
    return [list(ids) for ids in block_ids] if block_ids else []


@dataclass
class ReqState:
    """The scheduler's view of one request: its keys and save trackers."""

    keys: RequestKeys
    tracker: SaveTracker | None = None
    loaded: SaveTracker | None = None  # what this step loads from the store (not re-saved)
    unkeyable: bool = False  # its KV depends on inputs keys cannot name: neither loaded nor saved
    load_failed: bool = False  # an async load of it failed: recomputed, never reloaded
    # its preemption count when an asynchronous load was planned for it (None: none)
    async_load: int | None = None

    @property
    def request(self) -> Any:
        return self.keys.request


class SavePlanner:
    """Plans the saves of the requests in ``reqs`` (the scheduler's table, shared: the
    scheduler adds and drops requests, this reads them and sets their trackers).
    ``on_unkeyable`` is called once per request whose keys raise ``Unkeyable`` (its
    saves of that step are dropped); nothing is planned unless ``saves_enabled``."""

    def __init__(self, settings: ConnectorSettings, layout: EngineLayout, stats: Counters,
                 reqs: dict[str, ReqState], saves_enabled: bool,
                 on_unkeyable: Callable[[ReqState, Unkeyable], None]) -> None:
        self.settings = settings
        self.layout = layout
        self.stats = stats
        self._reqs = reqs
        self.saves_enabled = saves_enabled
        self._on_unkeyable = on_unkeyable

    def plan_saves(self, so: Any, meta: StepPlan) -> None:
        """Add to ``meta`` the saves of everything scheduler output ``so`` completes."""
        for req_id in so.preempted_req_ids or ():
            if req_id in self._reqs:
                self._reqs[req_id].tracker = None  # its pages are freed; resumes re-create it
        if not self.saves_enabled or not self.layout.servable:
            return
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            done = st.loaded or SaveTracker([])
            st.tracker = SaveTracker(block_tables(new.block_ids), done.saved_blocks, done.tail_end,
                                  done.state_end)
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
                st.tracker = SaveTracker(block_tables(new_ids))
            elif new_ids:
                if not st.tracker.tables:
                    st.tracker.tables = [[] for _ in new_ids]
                for table, ids in zip(st.tracker.tables, new_ids, strict=True):
                    table.extend(ids)
            self._plan_save(st, cached.num_computed_tokens[i] + so.num_scheduled_tokens[req_id],
                            meta)

    def _plan_save(self, st: ReqState, computed_after: int, meta: StepPlan) -> None:
        tr = st.tracker
        assert tr is not None
        if st.unkeyable:
            return
        blocks, states = len(meta.saves), len(meta.state_saves)
        try:
            self._plan_blocks(st, computed_after, meta)
            self._plan_tail(st, computed_after, meta)
            self._plan_state(st, computed_after, meta)
        except Unkeyable as exc:
            del meta.saves[blocks:], meta.state_saves[states:]
            self._on_unkeyable(st, exc)
            return
        req = st.request
        if ((len(meta.saves) > blocks or len(meta.state_saves) > states)
                and computed_after >= req.num_prompt_tokens
                and req.num_output_tokens + 1 >= req.max_tokens):
            meta.commit_now = True  # its response may complete with this step

    def _table(self, tr: SaveTracker) -> list[int]:
        """The block ids of the request's (first) attention group: how many pages it has."""
        groups = self.layout.groups
        if not tr.tables:
            return []
        return tr.tables[groups.attention[0].index] if groups is not None else tr.tables[0]

    def _save_pages(self, tr: SaveTracker, block: int, first_page: int = 0,
                    end_page: int | None = None) -> list[int] | None:
        """The pages of stored block ``block`` (None: a group no longer holds one)."""
        k, groups = self.layout.pages_per_object, self.layout.groups
        if groups is None:
            ids = tr.tables[0][block * k:(block + 1) * k]
            if first_page == 0 and end_page is None:
                return ids
            return object_pages(tr.tables[0], k, block, 1, first_page,
                                len(tr.tables[0]) if end_page is None else end_page)[0]
        return groups.save_pages(tr.tables, block, k, first_page, end_page)

    def _plan_blocks(self, st: ReqState, computed_after: int, meta: StepPlan) -> None:
        tr = st.tracker
        assert tr is not None
        limit = computed_after if self.settings.save_decode else min(
            computed_after, st.request.num_prompt_tokens)
        s, k = self.layout.stored_block_size, self.layout.pages_per_object
        full = min(limit // s, len(self._table(tr)) // k)
        if full > tr.saved_blocks:
            first = tr.saved_blocks
            refs = st.keys.blocks(max(first - 1, 0), full)
            parents: list[ObjectRef | None] = [None, *refs[:-1]] if first == 0 else [*refs[:-1]]
            pages = [self._save_pages(tr, b) for b in range(first, full)]
            keep = [i for i, p in enumerate(pages) if p is not None]  # hybrids: see groups.py
            mine = refs[-(full - first):]
            meta.saves.append(TransferSpec(st.request.request_id, [mine[i] for i in keep],
                                           [pages[i] or [] for i in keep],
                                           [parents[i] for i in keep]))
            tr.saved_blocks = full

    def _plan_tail(self, st: ReqState, computed_after: int, meta: StepPlan) -> None:
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
        tail = st.keys.tail(end) if end > tr.tail_end else None
        if tail is None:
            return
        s, page = self.layout.stored_block_size, self.layout.page_size
        block = end // s
        if -(-end // page) > len(self._table(tr)):
            return  # its pages are not all allocated (cannot happen after a real step)
        pages = self._save_pages(tr, block, block * s // page, -(-end // page))
        if pages is None:
            return
        parent = st.keys.blocks(block - 1, block)[0] if block else None
        meta.saves.append(TransferSpec(req.request_id, [tail], [pages], [parent]))
        tr.tail_end = end
        self.stats.add(saved_tails=1)

    def _plan_state(self, st: ReqState, computed_after: int, meta: StepPlan) -> None:
        """A hybrid model's recurrent state when this step ends on a stored-block boundary
        (mode ``align``: the state after ``computed_after`` tokens is in the page of that
        block; the worker saves it after the forward)."""
        req, tr, groups = st.request, st.tracker, self.layout.groups
        assert tr is not None
        s = self.layout.stored_block_size
        if (self.layout.state_geometry is None or groups is None or computed_after % s
                or computed_after <= tr.state_end
                or (computed_after > req.num_prompt_tokens and not self.settings.save_decode)):
            return
        pages = groups.state_page(tr.tables, computed_after)
        if pages is None:
            return
        ref = st.keys.state(computed_after)
        block = ObjectRef(ref.digest, ref.index, s)  # its parent: the block it ends
        meta.state_saves.append(TransferSpec(req.request_id, [ref], [pages], [block]))
        tr.state_end = computed_after
