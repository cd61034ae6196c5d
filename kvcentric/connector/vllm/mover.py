"""Copy KV pages between an engine's paged cache and store objects, one layer at a time.

A stored object holds one block of ``k`` engine pages for every layer, laid out
``[num_layers][k][page_bytes]``, where a page is one engine block of one layer
(``kv_layer[block_id]``, e.g. ``[num_kv_heads, block_size, 2*head_size]`` on vLLM CPU).

Objects that sit at a constant stride in memory (the store usually allocates a batch
back to back) form a *run*, viewed as one strided tensor ``[n, L, k, page_bytes]``, so a
layer moves with ``k`` calls of :func:`kernels.pack_blocks` / :func:`kernels.unpack_blocks`
per run rather than one per object.

Memory: object pointers belong to the store (slots / leases) and must stay valid while a
plan is used; the plan holds tensor views over them, never copies.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcentric import kernels

SKIP = -1  # a page id that must not be written (already computed by the engine)


@dataclass(frozen=True)
class ObjectGeometry:
    """``num_layers`` x ``pages_per_object`` pages of ``page_bytes`` per object."""

    num_layers: int
    pages_per_object: int
    page_bytes: int

    @property
    def object_bytes(self) -> int:
        return self.num_layers * self.pages_per_object * self.page_bytes


def host_bytes(ptr: int, nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor aliasing ``nbytes`` at ``ptr`` (the caller keeps the memory alive)."""
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=torch.uint8)


def find_runs(ptrs: Sequence[int], min_stride: int) -> list[tuple[int, int, int]]:
    """Split ``ptrs`` into maximal runs ``(start, end, stride)`` of constant stride.

    A run of one object has stride ``min_stride``; strides below ``min_stride`` (overlap)
    or negative never join a run.
    """
    runs: list[tuple[int, int, int]] = []
    i = 0
    while i < len(ptrs):
        j = i + 1
        stride = ptrs[j] - ptrs[i] if j < len(ptrs) else min_stride
        if stride < min_stride:
            stride = min_stride
            j = i + 1
        else:
            while j < len(ptrs) and ptrs[j] - ptrs[j - 1] == stride:
                j += 1
        runs.append((i, j, stride))
        i = j
    return runs


class PagePlan:
    """Views and page ids for moving pages of a fixed set of objects.

    Args:
        geometry: object shape.
        ptrs: host address of each object.
        page_ids: per object, ``k`` engine block ids (``SKIP`` = leave that page alone).
        impl: kernel implementation (``"auto"``: Triton on CUDA, torch on CPU).
    """

    def __init__(self, geometry: ObjectGeometry, ptrs: Sequence[int],
                 page_ids: Sequence[Sequence[int]], impl: str = "auto") -> None:
        if len(ptrs) != len(page_ids):
            raise ValueError("one page-id list per object is required")
        k = geometry.pages_per_object
        if any(len(p) != k for p in page_ids):
            raise ValueError(f"every object has exactly {k} pages")
        self.geometry = geometry
        self.impl = impl
        self._runs: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        size = geometry.object_bytes
        for start, end, stride in find_runs(ptrs, size):
            n = end - start
            mem = host_bytes(ptrs[start], (n - 1) * stride + size)
            view = mem.as_strided((n, geometry.num_layers, k, geometry.page_bytes),
                                  (stride, k * geometry.page_bytes, geometry.page_bytes, 1))
            ids = torch.tensor([list(p) for p in page_ids[start:end]], dtype=torch.int64)
            self._runs.append((view, ids, bool((ids == SKIP).any())))

    def page_ids(self) -> list[int]:
        """Every engine block id this plan writes or reads (SKIP excluded)."""
        return [int(p) for _, ids, _ in self._runs for p in ids.flatten() if int(p) != SKIP]

    @property
    def num_objects(self) -> int:
        return sum(v.shape[0] for v, _, _ in self._runs)

    def pack_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        """Copy this layer's pages from ``kv_layer`` (blocks on dim 0) into the objects."""
        for view, ids, masked in self._runs:
            for j in range(self.geometry.pages_per_object):
                self._move(view[:, layer, j], ids[:, j], kv_layer, masked, pack=True)

    def unpack_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        """Copy this layer's pages from the objects into ``kv_layer``."""
        for view, ids, masked in self._runs:
            for j in range(self.geometry.pages_per_object):
                self._move(view[:, layer, j], ids[:, j], kv_layer, masked, pack=False)

    def _move(self, rows: torch.Tensor, ids: torch.Tensor, kv_layer: torch.Tensor,
              masked: bool, pack: bool) -> None:
        if masked:
            keep = (ids != SKIP).nonzero().flatten().tolist()
            for r in keep:  # rare: the one object a local prefix hit covers in part
                self._move(rows[r:r + 1], ids[r:r + 1], kv_layer, False, pack)
            return
        if pack:
            kernels.pack_blocks(kv_layer, ids, rows, impl=self.impl)
        else:
            kernels.unpack_blocks(rows, ids, kv_layer, impl=self.impl)
