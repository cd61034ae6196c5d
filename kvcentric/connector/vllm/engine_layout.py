"""Derive the stored-object layout from vLLM's configs (same answer in every process).

The scheduler needs keys before any tensor exists, so everything that decides the bytes
of a page comes from ``kv_cache_config`` and the platform, never from the tensors; the
worker checks the registered tensors against it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvcentric.connector.vllm.groups import GroupPlan, group_plan
from kvcentric.connector.vllm.mover import ObjectGeometry
from kvcentric.hashing import KeySpace
from kvcentric.integrity import ObjectHeaders
from kvcentric.model_revision import directory_revision
from kvcentric.stored_layout import KVLayout, dtype_name

log = logging.getLogger("kvcentric.connector")


@dataclass(frozen=True)
class EngineLayout:
    """Keys and object geometry of one engine (one TP rank).

    ``writer``: this rank stores what it computes. False on the ranks whose KV another
    rank already stores: MLA's latent KV is the same on every TP rank, so its key space
    is ``{dcp_rank}of{dcp_size}`` (``0of1`` without decode context parallelism) and only
    the ranks of the first DCP group write; every rank reads the one copy.

    ``groups``: the engine's KV cache groups (:mod:`kvcentric.connector.vllm.groups`;
    None: one full-attention group, the layers given to the worker).
    ``state_geometry``: the shape of a hybrid model's state objects (None: no recurrent
    group, or one that cannot be served).
    ``load_async``: loads were asked to run beside the steps (the connector's
    ``async_loads``; :attr:`async_loads` is also true when vLLM requires it).
    """

    layout: KVLayout
    geometry: ObjectGeometry
    keyspace: KeySpace
    page_size: int  # engine tokens per page
    writer: bool = True
    groups: GroupPlan | None = None
    state_geometry: ObjectGeometry | None = None
    load_async: bool = False

    @property
    def stored_block_size(self) -> int:
        return self.layout.block_size

    @property
    def pages_per_object(self) -> int:
        return self.geometry.pages_per_object

    def rank_keyspaces(self) -> list[KeySpace]:
        """The key space of every TP rank of this engine (the scheduler looks up all)."""
        ks = self.keyspace
        if ks.tp_size == 1:
            return [ks]
        return [replace(ks, tp_rank=r) for r in range(ks.tp_size)]

    def headers(self) -> ObjectHeaders:
        """Header writer/checker for this rank's objects (:mod:`kvcentric.integrity`)."""
        return ObjectHeaders(self.keyspace, self.geometry.payload_bytes)

    def state_headers(self) -> ObjectHeaders | None:
        """Header writer/checker for this rank's state objects (None: none stored)."""
        g = self.state_geometry
        return None if g is None else ObjectHeaders(self.keyspace, g.payload_bytes)

    @property
    def async_loads(self) -> bool:
        """Loads of this engine run beside its steps and complete between them (vLLM's
        asynchronous load: the request waits in ``WAITING_FOR_REMOTE_KVS`` and computes
        nothing until its load is reported done): asked for (:attr:`load_async`), or
        required by :attr:`failures_by_request`."""
        return self.load_async or self.failures_by_request

    @property
    def failures_by_request(self) -> bool:
        """A failed load is reported as a failed request, never as block ids: with
        several KV cache groups block ids are not unique, so vLLM takes a failed load
        only as a failed request (which it recomputes from scratch), and only from an
        asynchronous load."""
        return self.groups is not None and self.groups.hybrid

    @property
    def servable(self) -> bool:
        """False when a KV cache group cannot be served: no hits, no saves."""
        return self.groups is None or not self.groups.unservable

    @property
    def tails(self) -> bool:
        """Tails (partial last blocks) are stored and loaded: not with a recurrent group,
        whose state exists at block boundaries only."""
        return self.groups is None or not self.groups.states


def model_revision(vllm_config: object, configured: str | None) -> str:
    """``configured``, else the digest of the model's directory when it is a local one
    (:func:`kvcentric.model_revision.directory_revision`), else the revision vLLM was
    asked for; ``""`` (logged) when none is known: keys then name the model only."""
    if configured:
        return configured
    mc = vllm_config.model_config  # type: ignore[attr-defined]
    if Path(str(mc.model)).is_dir():
        rev = directory_revision(str(mc.model))
        if rev:
            return rev
    rev = str(mc.revision or "")
    if not rev:
        log.warning("the revision of model %s is not known; set kvcentric's "
                    "model_revision so that new weights under this name never load old KV",
                    mc.model)
    return rev


def _cpu_isa(dtype: torch.dtype, page_size: int, head_size: int, cache_dtype: str) -> str:
    """The ISA vLLM CPU packs pages for (pages are prepacked per ISA, so it is in the key)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(dtype, page_size, head_size, cache_dtype))
    except (ImportError, NotImplementedError):
        return "unknown"


def engine_layout(vllm_config: object, kv_cache_config: object, stored_block_size: int,
                  model_id: str, tp_rank: int = 0, revision: str = "") -> EngineLayout:
    """Layout, geometry and key space for ``vllm_config`` / ``kv_cache_config``.

    Raises ``ValueError`` for models the connector cannot serve (a KV cache group of a
    kind it does not know, attention groups of different page sizes) or a stored block
    size that is not a page multiple (:func:`kvcentric.connector.vllm.groups.group_plan`).
    """
    plan = group_plan(kv_cache_config, stored_block_size)
    specs = [kv_cache_config.kv_cache_groups[g.index].kv_cache_spec  # type: ignore[attr-defined]
             for g in plan.attention]
    spec, page = specs[0], plan.page_size
    mla = all(type(s).__name__.endswith("MLAAttentionSpec") or
              type(s).__name__ == "SlidingWindowMLASpec" for s in specs)
    cache_dtype = str(vllm_config.cache_config.cache_dtype)  # type: ignore[attr-defined]
    device = str(vllm_config.device_config.device_type)  # type: ignore[attr-defined]
    kv_layout = str(kv_cache_config.kv_cache_layout or "default")  # type: ignore[attr-defined]
    name = f"{device}:{kv_layout}"
    if device == "cpu":
        name += ":" + _cpu_isa(spec.dtype, page, int(spec.head_size), cache_dtype)
    layout = KVLayout(num_layers=len(plan.layers), block_size=stored_block_size,
                      num_kv_heads=int(spec.num_kv_heads), head_dim=int(spec.head_size),
                      dtype=dtype_name(spec.dtype), layout=name, mla=mla, revision=revision,
                      groups=plan.signature())
    geometry = ObjectGeometry(layout.num_layers, stored_block_size // page,
                              plan.attention[0].page_bytes)
    state_geometry = None
    if plan.states and not plan.unservable:
        state_geometry = ObjectGeometry(len(plan.state_layers), 1, plan.states[0].page_bytes)
    rank, size, writer = key_rank(vllm_config.parallel_config, mla, tp_rank)  # type: ignore[attr-defined]
    keyspace = KeySpace(model_id, layout.signature(), rank, size)
    return EngineLayout(layout, geometry, keyspace, page, writer,
                        plan if plan.hybrid or plan.attention[0].kind != "full" else None,
                        state_geometry)


def key_rank(parallel: object, mla: bool, tp_rank: int) -> tuple[int, int, bool]:
    """(key rank, key ranks, writer) of TP rank ``tp_rank``: MHA shards KV heads over TP
    ranks, each rank its own keys; MLA's latent KV is replicated over TP ranks except for
    decode context parallelism, whose groups are consecutive TP ranks of ``dcp`` (vLLM's
    ``parallel_state``): ranks with one DCP rank hold the same KV. With prefill context
    parallelism the rank layout differs: MLA then keeps per-rank keys."""
    tp = int(parallel.tensor_parallel_size)  # type: ignore[attr-defined]
    dcp = int(parallel.decode_context_parallel_size)  # type: ignore[attr-defined]
    if not mla or int(parallel.prefill_context_parallel_size) > 1:  # type: ignore[attr-defined]
        return tp_rank, tp, True
    return tp_rank % dcp, dcp, tp_rank < dcp
