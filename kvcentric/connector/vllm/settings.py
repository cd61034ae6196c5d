"""Connector settings, parsed once from vLLM's ``kv_connector_extra_config``.

Example::

    {"store": {"backend": "local", "name": "default", "capacity": "8gb"},
     "block_size": 256, "model_id": "llama-3-8b", "load_failure_policy": "recompute"}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvcentric.config import StoreConfig, parse_fields
from kvcentric.stored_layout import stored_block_size

COPY_IMPLS = ("auto", "torch", "triton", "dma")  # = kernels.IMPLS; settings never import torch


@dataclass(frozen=True)
class ConnectorSettings:
    """What the vLLM connector needs beyond vLLM's own config.

    Fields:
        store: which store to use (see :class:`kvcentric.config.StoreConfig`).
        block_size: tokens per stored object; a multiple of the engine's page size.
            ``None``: the page size when it is >= 128 tokens (vLLM CPU), else the smallest
            page multiple >= 256 (GPU pages of 16). A hit always recomputes the partial
            last stored block, so a block coarser than the page costs TTFT (up to a
            block of tokens recomputed on every hit, which the engine's own hit does not).
        model_id: namespace of the keys; ``None`` uses the served model name.
        model_revision: names the model's weights in the keys; ``None`` uses a digest of
            the model directory's weights and configs when it is local
            (:mod:`kvcentric.model_revision`), else the revision vLLM loads. Set it when
            neither is known, so new weights under an old name never load old KV.
        load_failure_policy: what vLLM does after a failed load. ``"recompute"`` (our
            default; a cache is best effort) or ``"fail"``.
        save_decode: also store full blocks of generated tokens (multi-turn reuse).
        load_timeout_s: bound on a step's waits for its copy jobs (loads, and packs queued
            behind them), plus their bytes at ``store.min_transfer_rate``: past it the
            step's loads are recomputed and its saves dropped. The store bounds each of its
            own calls (``store.hot_timeout_s``), so this is a backstop a little above those.
        async_copy: copy pages on a background thread so copies overlap layer compute.
        async_commit: publish a step's saved objects on a background thread once their
            pages are copied out of the KV cache, so the step (and the request's first
            token) does not wait for the store's commit (Mooncake: the transfer to the
            storage node). A step that may end a saving request commits before it returns,
            so a finished request's KV is in the store when its response completes. Forced
            off for ``kv_producer`` (a P/D decode must find the prefill's blocks at once).
        min_fetch_bytes: a streamed load (Mooncake ``ranged_reads``) fetches the ranges of
            consecutive layers together until a call moves at least this many bytes: every
            store call has a fixed cost, which one call per layer pays once per layer
            (slower than one whole get when layers are small), and the first group is all
            the forward waits for.
        spare_cpu_threads: on a CPU engine whose worker is pinned to its compute cores, run
            the copy and commit threads and the store client's threads on the other cores
            (:mod:`kvcentric.connector.vllm.affinity`); no effect on GPU workers.
        handoff_pin_s: on a P/D prefill (``kv_producer``), what it saves is soft-pinned in
            the store for this long or until the decode's first read, so eviction pressure
            between save and load cannot turn the handoff into a recompute (0: no pins).
        copy_impl: how pages are copied (:mod:`kvcentric.kernels.dispatch`): ``"auto"``
            (CPU: torch; CUDA: staged through HBM with torch index ops and one 2-D DMA
            per layer, :mod:`kvcentric.kernels.staged`), ``"torch"``, ``"triton"``,
            ``"dma"`` (on CUDA: the kernel that gathers/scatters in HBM).
        pin_host_memory: on a CUDA worker, register the store's host memory with CUDA so
            copies run as asynchronous DMA (refusals are logged and counted; the copies
            then go through the driver's staging, synchronously).
        async_loads: load a request's KV beside the engine's steps (vLLM's asynchronous
            load): the request waits, holding its pages, while its objects are copied in
            on a load thread (on CUDA, copy streams), and computes from the step after
            its load is done. The running batch's steps never wait for it: what a P/D
            decode instance needs, whose every request loads a whole prompt with nothing
            to compute beside it (a synchronous load stalls every decode in the batch for
            the transfer). A synchronous load instead overlaps the request's own prefill
            layer by layer and costs no extra step: better where the uncached rest of the
            prompt is long. ``None``: asynchronous on a ``kv_consumer`` (a P/D decode
            instance), synchronous otherwise. Models with several KV cache groups load
            asynchronously whatever this says (vLLM requires it).
        full_cudagraphs: keep vLLM's full CUDA graphs (``FULL_AND_PIECEWISE``): a step
            that replays one runs no layer hooks, so its loads finish before the forward
            and its saves run after it. ``False`` asks vLLM for PIECEWISE graphs (layer
            hooks in every step, at the cost of splitting every decode graph).
    """

    store: StoreConfig = field(default_factory=StoreConfig)
    block_size: int | None = None
    model_id: str | None = None
    model_revision: str | None = None
    load_failure_policy: str = "recompute"
    save_decode: bool = True
    load_timeout_s: float = 0.5
    async_copy: bool = True
    async_commit: bool = True
    spare_cpu_threads: bool = True
    min_fetch_bytes: int = 16 << 20
    handoff_pin_s: float = 30.0
    copy_impl: str = "auto"
    pin_host_memory: bool = True
    full_cudagraphs: bool = True
    async_loads: bool | None = None

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.load_failure_policy not in ("recompute", "fail"):
            raise ValueError("load_failure_policy must be 'recompute' or 'fail'")
        if self.load_timeout_s <= 0:
            raise ValueError("load_timeout_s must be > 0")
        if self.min_fetch_bytes <= 0:
            raise ValueError("min_fetch_bytes must be > 0")
        if not 0 <= self.handoff_pin_s <= 3600:
            raise ValueError("handoff_pin_s must be in [0, 3600]")
        if self.copy_impl not in COPY_IMPLS:
            raise ValueError(f"copy_impl must be one of {COPY_IMPLS}, got {self.copy_impl!r}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        kw = parse_fields(cls, extra, "kvcentric connector options", sizes={"min_fetch_bytes"})
        kw["store"] = StoreConfig.from_dict(kw.get("store"))
        return cls(**kw)

    def loads_async(self, kv_role: str) -> bool:
        """Whether an engine in ``kv_role`` loads asynchronously (``async_loads``)."""
        return kv_role == "kv_consumer" if self.async_loads is None else self.async_loads

    def stored_block_size(self, page_size: int) -> int:
        """Tokens per stored object for an engine with ``page_size``-token pages
        (:func:`kvcentric.stored_layout.stored_block_size`)."""
        return stored_block_size(page_size, self.block_size)
