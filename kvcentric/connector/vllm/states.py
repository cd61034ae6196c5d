"""Worker side of a hybrid model's recurrent-state objects (Mamba, short conv).

A recurrent layer keeps no per-token pages: its KV cache group (``MambaSpec``, mamba cache
mode ``align``) holds, per block-table entry ``j``, the layer's state after
``(j + 1) * block_size`` tokens: a few tensors (e.g. conv and SSM state) that vLLM lays out
inside one padded page per block. A *state object* (:mod:`kvcentric.connector.vllm.groups`)
is ``[header][L_state][1][state_bytes]``: for every recurrent layer in model order, the
state bytes of one block-table entry, taken from that layer's group's page.

These layers call no connector hook (``wait_for_layer_load``, ``save_kv_layer``): a state
is saved from the cache after the forward (``finish_step``) and loaded before the forward
of the step that reads it -- hybrid loads are asynchronous, so the load completes in a step
whose forward does not run the loading request. Every object's header is checked before a
byte is copied; a failure is reported per request (the scheduler recomputes it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvcentric.connector.vllm.counters import Counters
from kvcentric.connector.vllm.engine_layout import EngineLayout
from kvcentric.connector.vllm.mover import SKIP, PageKernel, PagePlan
from kvcentric.connector.vllm.transfers import TransferSpec
from kvcentric.integrity import describe
from kvcentric.store import KVStore, StoreUnavailable, WriteSlot

log = logging.getLogger("kvcentric.connector")


def state_pages(tensors: torch.Tensor | Sequence[torch.Tensor], state_bytes: int) -> torch.Tensor:
    """One recurrent layer's cache as a uint8 view ``[num_blocks, state_bytes]``: row ``j``
    is the bytes of every state tensor of block ``j``.

    ``tensors``: vLLM's per-layer state tensors (``[num_blocks, ...]`` views into one
    buffer whose block stride is the padded page). ValueError when they do not share
    one block stride or do not fill exactly ``state_bytes`` from the page's start (the
    layout ``groups`` derived from the configs would not match the memory).
    """
    ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    base = min(t.data_ptr() for t in ts)
    strides = {t.stride(0) * t.element_size() for t in ts}
    if len(strides) != 1:
        raise ValueError(f"state tensors with different block strides {sorted(strides)}")
    stride = strides.pop()
    span = max(t.data_ptr() - base + t.element_size() * (1 + sum(
        (n - 1) * st for n, st in zip(t.shape[1:], t.stride()[1:], strict=True)))
        for t in ts)
    if span != state_bytes or span > stride:
        raise ValueError(f"recurrent state spans {span} B of a {stride}-byte page, the "
                         f"configs say {state_bytes} B")
    storage = ts[0].untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=ts[0].device).set_(storage)
    return raw.as_strided((ts[0].shape[0], span), (stride, 1), base - storage.data_ptr())


class StateObjects:
    """Loads and saves one worker's state objects (headers checked, pages moved)."""

    def __init__(self, layout: EngineLayout, store: KVStore, stats: Counters) -> None:
        groups, geometry, headers = layout.groups, layout.state_geometry, layout.state_headers()
        assert groups is not None and geometry is not None and headers is not None
        self.layout, self.store, self.stats = layout, store, stats
        self.geometry, self.headers = geometry, headers
        self.names = list(groups.state_layers)
        group_of = {n: j for j, g in enumerate(groups.states) for n in g.layers}
        self._layer_groups = [group_of[n] for n in self.names]
        self._pages: list[torch.Tensor] = []
        self._kernel = PageKernel()

    def register(self, kv_caches: dict[str, torch.Tensor | Sequence[torch.Tensor]]) -> None:
        """Find every recurrent layer's state pages (:func:`state_pages`)."""
        missing = set(self.names) - set(kv_caches)
        if missing:
            raise ValueError(f"no state cache registered for layers {sorted(missing)[:3]}")
        self._pages = [state_pages(kv_caches[n], self.geometry.page_bytes) for n in self.names]

    def _plan(self, ptrs: list[int], page_ids: list[list[int]]) -> PagePlan:
        return PagePlan(self.geometry, ptrs, page_ids, self._kernel, self._layer_groups)

    def load(self, specs: Sequence[TransferSpec]) -> set[str]:
        """Copy each spec's state object into its pages (one page per state group), all
        layers, now; returns the ids of the requests whose load failed (missing object,
        store down, header mismatch, no page to load into): nothing of theirs is written."""
        failed: set[str] = set()
        size = self.geometry.object_bytes
        for spec in specs:
            ref, pages = spec.refs[0], spec.page_ids[0]
            if SKIP in pages or not self._pages:
                failed.add(spec.req_id)
                continue
            try:
                lease = self.store.batch_acquire([ref.key(self.layout.keyspace)], [size])
            except StoreUnavailable as exc:
                log.warning("store unavailable, recomputing request %s: %s", spec.req_id, exc)
                failed.add(spec.req_id)
                continue
            try:
                if len(lease.ptrs) != 1 or lease.sizes[0] != size:
                    failed.add(spec.req_id)
                    continue
                if not self.headers.check(lease.ptrs[0], ref):
                    log.error("integrity: state object %s was written for %s, expected %s; "
                              "recomputing", lease.keys[0], self.headers.describe(lease.ptrs[0]),
                              describe(self.headers.expected(ref)))
                    self.stats.add(integrity_errors=1)
                    failed.add(spec.req_id)
                    continue
                plan = self._plan([lease.ptrs[0]], [pages])
                for layer, kv in enumerate(self._pages):
                    plan.unpack_layer(layer, kv)
                if not self.store.lease_valid(lease):  # torn while copied: recompute
                    failed.add(spec.req_id)
                    continue
                self.stats.add(loaded_states=1, loaded_bytes=size)
            finally:
                self.store.release(lease)
        if failed:
            self.stats.add(load_errors=len(failed))
        return failed

    def save(self, specs: Sequence[TransferSpec]) -> list[WriteSlot]:
        """Reserve and fill the state objects of ``specs`` from the cache as it is now
        (after the step's forward); returns the slots to commit (None-slots: already
        stored, or a store that is down)."""
        if not specs or not self._pages:
            return []
        ks, size = self.layout.keyspace, self.geometry.object_bytes
        refs = [spec.refs[0] for spec in specs]
        keys = [ref.key(ks) for ref in refs]
        parents = [spec.parents[0].key(ks) if spec.parents and spec.parents[0] else None
                   for spec in specs]
        try:
            slots = self.store.batch_alloc(keys, [size] * len(keys), parents)
        except StoreUnavailable as exc:
            log.warning("store unavailable, not saving %d states: %s", len(keys), exc)
            return []
        live = [(slot, spec.page_ids[0], ref) for slot, spec, ref in zip(slots, specs, refs)
                if slot is not None]
        if not live:
            return []
        try:
            for slot, _, ref in live:
                self.headers.write(slot.ptr, ref)
            plan = self._plan([s.ptr for s, _, _ in live], [p for _, p, _ in live])
            for layer, kv in enumerate(self._pages):
                plan.pack_layer(layer, kv)
        except Exception as exc:
            log.error("saving %d states failed: %s", len(live), exc, exc_info=True)
            self.store.batch_abort([s for s, _, _ in live])
            return []
        return [s for s, _, _ in live]
