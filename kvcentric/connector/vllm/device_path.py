"""How one worker's pages move on its device: block dim, kernels, streams, pinned memory.

On a CPU engine: copies are synchronous torch copies on the copy thread, nothing else.
On a CUDA engine (:meth:`DevicePath.open`):

1. the store's host memory (slots and leases point into it) is registered with CUDA
   (:class:`kvcentric.cuda.HostPinner`; refused or CPU: logged, counted, pageable);
2. the fastest kernel per direction is measured once on the engine's own layer and a
   pinned scratch buffer (:func:`kvcentric.kernels.autotune.fastest`: Triton gather vs
   per-page DMA vs torch), unless the settings name one;
3. copies are ordered by events on a copy stream (:class:`kvcentric.cuda.CopyOrdering`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvcentric.connector.vllm.mover import PageKernel, block_dim_of
from kvcentric.cuda import CopyOrdering, HostPinner
from kvcentric.kernels.autotune import fastest
from kvcentric.store import KVStore

log = logging.getLogger("kvcentric.connector")
CALIBRATION_PAGES = 32  # pages per timed call: a typical step's per-layer batch


@dataclass
class DevicePath:
    """``kernel`` is what :class:`~kvcentric.connector.vllm.mover.PagePlan` copies with;
    ``ordering`` and ``pinner`` exist on CUDA only."""

    kernel: PageKernel
    ordering: CopyOrdering | None = None
    pinner: HostPinner | None = None

    @classmethod
    def open(cls, layer: torch.Tensor, page_bytes: int, store: KVStore, impl: str = "auto",
             pin_host_memory: bool = True) -> DevicePath:
        """The path for a worker whose KV layers look like ``layer``; on CUDA, pins the
        store's memory (``pin_host_memory``) and measures kernels (``impl="auto"``)."""
        block_dim = block_dim_of(layer, page_bytes)
        if layer.device.type != "cuda":
            return cls(PageKernel(block_dim, impl, impl))
        pinner = HostPinner()
        if pin_host_memory:
            store.pin_host_memory(pinner)
        pack, unpack = (impl, impl) if impl != "auto" else _measure(layer, block_dim,
                                                                     page_bytes)
        return cls(PageKernel(block_dim, pack, unpack, pin_ids=True),
                   CopyOrdering(layer.device), pinner)

    def close(self) -> None:
        if self.pinner is not None:
            self.pinner.close()


def _measure(layer: torch.Tensor, block_dim: int, page_bytes: int) -> tuple[str, str]:
    """Fastest (pack, unpack) impl on ``layer``'s first pages and pinned scratch rows.
    The pages are rewritten with their own bytes (unchanged)."""
    n = min(CALIBRATION_PAGES, layer.shape[block_dim])
    rows = torch.empty((n, page_bytes), dtype=torch.uint8, pin_memory=True)
    ids = torch.arange(n, dtype=torch.int64)
    pack, unpack = fastest(layer, ids, rows, block_dim=block_dim)
    log.info("kvcentric: page copies use %s to save (%s) and %s to load (%s) for %s pages "
             "of %d B", pack.impl, _fmt(pack.seconds), unpack.impl, _fmt(unpack.seconds),
             tuple(layer.shape), page_bytes)
    return pack.impl, unpack.impl


def _fmt(seconds: dict[str, float]) -> str:
    return ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in seconds.items())
