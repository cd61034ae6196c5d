"""How one worker's pages move on its device: block dim, kernels, streams, pinned memory.

On a CPU engine: copies are synchronous torch copies on the copy thread, nothing else.
On a CUDA engine (:meth:`DevicePath.open`):

1. the store's host memory (slots and leases point into it) is registered with CUDA
   (:class:`kvcentric.cuda.HostPinner`; refused or CPU: logged, counted, pageable);
2. pages move *staged* (:mod:`kvcentric.kernels.staged`): gathered/scattered in HBM
   through a scratch buffer by one torch index op, crossing PCIe as one 2-D DMA
   per layer over the objects' spans. Page by page across PCIe (Triton over UVA,
   per-page DMA, torch into strided host rows) is several times slower on an H100, and
   the generic validating kernels spend Python per layer on every step
   (``benchmarks/micro/gpu_path.py`` and its results); a ``copy_impl`` other than ``auto`` makes the
   HBM side use that kernel;
3. copies are ordered by events on a copy stream (:class:`kvcentric.cuda.CopyOrdering`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcentric.connector.vllm.mover import PageKernel, block_dim_of
from kvcentric.cuda import CopyOrdering, HostPinner
from kvcentric.store import KVStore


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
        store's memory (``pin_host_memory``) and moves pages staged."""
        block_dim = block_dim_of(layer, page_bytes)
        if layer.device.type != "cuda":
            return cls(PageKernel(block_dim, impl, impl))
        pinner = HostPinner()
        if pin_host_memory:
            store.pin_host_memory(pinner)
        return cls(PageKernel(block_dim, impl, impl, pin_ids=True, staged=True,
                              ids_device=layer.device), CopyOrdering(layer.device), pinner)

    def close(self) -> None:
        if self.pinner is not None:
            self.pinner.close()

