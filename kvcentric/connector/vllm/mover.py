"""Copy KV pages between an engine's paged cache and store objects, one layer at a time.

A stored object is a header region (``header_bytes``, :mod:`kvcentric.integrity`; the
mover never touches it) and a payload holding one block of ``k`` engine pages for every
layer, laid out ``[num_layers][k][page_bytes]``, where a page is one engine block of one layer: the
layer tensor with its block dim removed (``PageKernel.block_dim``), e.g. vLLM CPU's
``[num_blocks, num_kv_heads, block_size, 2*head_size]`` (block dim 0), FlashAttention's
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (block dim 1: a page is K then V),
FlashInfer's ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (0; the same page
bytes as FlashAttention), MLA's ``[num_blocks, block_size, 576]`` (0).

Objects that sit at a constant stride in memory (the store usually allocates a batch
back to back) form a *run*, viewed as one strided tensor ``[n, L, k, page_bytes]``, so a
layer moves with ``k`` calls of :func:`kernels.pack_blocks` / :func:`kernels.unpack_blocks`
per run rather than one per object. With CUDA layers (``PageKernel.staged``) a layer of a
run moves with one :func:`kernels.staged.staged_pack` / ``staged_unpack`` call instead:
the pages are gathered in HBM and cross PCIe as one DMA per object (``[k, page_bytes]``
is contiguous in an object).

Memory: object pointers belong to the store (slots / leases) and must stay valid while a
plan is used; the plan holds tensor views over them, never copies.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcentric import kernels
from kvcentric.connector.vllm.transfers import SKIP
from kvcentric.integrity import HEADER_BYTES
from kvcentric.kernels.dispatch import TensorSig, tensor_sig
from kvcentric.kernels.staged import (
    staged_pack,
    staged_pack_layers,
    staged_unpack,
    staged_unpack_layers,
)


@dataclass(frozen=True)
class PageKernel:
    """How pages move: the layers' block dim and the kernel implementation per direction
    (see :mod:`kvcentric.kernels.dispatch`; on CUDA the HBM side of the staged copies).
    ``pin_ids``: keep the block-id tensors in pinned memory so moving them to the GPU
    never synchronises the host. ``staged``: CUDA layers, host objects: move a layer's
    pages through a device scratch (see the module docstring); the impls then name the
    device-side gather/scatter. ``ids_device``: move a plan's block ids there once, when
    the plan is made (on the current stream, which the copies are ordered after), rather
    than once per layer."""

    block_dim: int = 0
    pack_impl: str = "auto"
    unpack_impl: str = "auto"
    pin_ids: bool = False
    staged: bool = False
    ids_device: torch.device | None = None


def block_dim_of(kv_layer: torch.Tensor, page_bytes: int) -> int:
    """The block dim of a vLLM layer tensor whose pages are ``page_bytes``: 0 (vLLM CPU,
    FlashInfer, MLA) or 1 (FlashAttention's ``[2, num_blocks, ...]``). ValueError when
    neither fits, or both do with a leading 2 (``[2, 2, ...]``: K/V or two blocks?)."""
    total = kv_layer.numel() * kv_layer.element_size()
    fits = [d for d in range(min(2, kv_layer.dim()))
            if kv_layer.shape[d] and total // kv_layer.shape[d] == page_bytes]
    if not fits or (len(fits) == 2 and kv_layer.shape[0] == 2):
        raise ValueError(f"cannot tell the block dim of a KV layer of shape "
                         f"{tuple(kv_layer.shape)} with {page_bytes}-byte pages")
    return fits[0]


@dataclass(frozen=True)
class ObjectGeometry:
    """A ``header_bytes`` header region, then ``num_layers`` x ``pages_per_object`` pages
    of ``page_bytes`` per object."""

    num_layers: int
    pages_per_object: int
    page_bytes: int
    header_bytes: int = HEADER_BYTES

    @property
    def payload_bytes(self) -> int:
        return self.num_layers * self.pages_per_object * self.page_bytes

    @property
    def object_bytes(self) -> int:
        return self.header_bytes + self.payload_bytes

    def layer_range(self, first: int, count: int) -> tuple[int, int]:
        """(offset, size) in an object of layers ``[first, first + count)``; a range that
        starts at layer 0 includes the header (one fetch brings both)."""
        span = self.pages_per_object * self.page_bytes
        start = self.header_bytes + first * span
        end = self.header_bytes + (first + count) * span
        return (0, end) if first == 0 else (start, end - start)


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


@dataclass(frozen=True)
class _Run:
    """Objects at a constant stride: ``view`` ``[n, L, k, page_bytes]`` over their memory;
    ``by_page`` ``[k, n]`` (row ``j``: page ``j`` of every object, contiguous for one
    kernel call per page); ``flat_ids`` the non-SKIP ids object-major, and ``positions``
    their places among the ``n * k`` pages (None when no page is SKIP)."""

    view: torch.Tensor
    by_page: torch.Tensor
    masked: bool
    flat_ids: torch.Tensor
    positions: torch.Tensor | None

    @classmethod
    def of(cls, view: torch.Tensor, ids: torch.Tensor, kernel: PageKernel) -> _Run:
        """``ids``: ``[n, k]`` engine block ids (SKIP allowed)."""
        flat = ids.flatten()
        keep = (flat != SKIP).nonzero().flatten()
        masked = len(keep) < len(flat)
        positions = keep if masked else None
        if masked:
            flat = flat[keep]
        by_page, flat = ids.t().contiguous(), flat.contiguous()
        if kernel.pin_ids:
            by_page, flat = by_page.pin_memory(), flat.pin_memory()
            positions = positions.pin_memory() if positions is not None else None
        if kernel.ids_device is not None:
            flat = flat.to(kernel.ids_device, non_blocking=True)
            if positions is not None:
                positions = positions.to(kernel.ids_device, non_blocking=True)
        return cls(view, by_page, masked, flat, positions)


class PagePlan:
    """Views and page ids for moving pages of a fixed set of objects.

    Args:
        geometry: object shape.
        ptrs: host address of each object (its header's first byte).
        page_ids: per object, ``k`` engine block ids (``SKIP`` = leave that page alone);
            with ``layer_groups``, ``k`` per group, concatenated in group order.
        kernel: the layers' block dim and the implementations to copy with.
        layer_groups: per layer of the object, the group whose page ids it uses (a
            hybrid model's KV cache groups each have their own block table); None: one
            group, every layer uses the same ids.
    """

    def __init__(self, geometry: ObjectGeometry, ptrs: Sequence[int],
                 page_ids: Sequence[Sequence[int]], kernel: PageKernel = PageKernel(),
                 layer_groups: Sequence[int] | None = None) -> None:
        if len(ptrs) != len(page_ids):
            raise ValueError("one page-id list per object is required")
        k = geometry.pages_per_object
        groups = 1 if layer_groups is None else max(layer_groups, default=0) + 1
        if layer_groups is not None and len(layer_groups) != geometry.num_layers:
            raise ValueError(f"one group per layer is required ({geometry.num_layers})")
        if any(len(p) != k * groups for p in page_ids):
            raise ValueError(f"every object has exactly {k} pages per group ({groups})")
        self.geometry = geometry
        self.kernel = kernel
        self._layer_groups = layer_groups
        self._groups: list[list[_Run]] = [[] for _ in range(groups)]  # runs per group
        size = geometry.object_bytes
        head = geometry.header_bytes
        for start, end, stride in find_runs(ptrs, size):
            n = end - start
            mem = host_bytes(ptrs[start] + head, (n - 1) * stride + size - head)
            view = mem.as_strided((n, geometry.num_layers, k, geometry.page_bytes),
                                  (stride, k * geometry.page_bytes, geometry.page_bytes, 1))
            for g, runs in enumerate(self._groups):
                ids = torch.tensor([list(p[g * k:(g + 1) * k]) for p in page_ids[start:end]],
                                   dtype=torch.int64)
                runs.append(_Run.of(view, ids, kernel))
        self._runs = self._groups[0]
        # (run, page, pack, layer shape) -> the copy validated on the first layer of that
        # shape: the other layers reuse its checked ids and implementation (copy threads
        # may build one twice at once; either is valid)
        self._copies: dict[tuple[int, int, bool, TensorSig], kernels.PagedCopy] = {}

    def page_ids(self) -> list[int]:
        """Every engine block id this plan writes or reads (SKIP excluded)."""
        return [int(p) for runs in self._groups for run in runs
                for p in run.by_page.flatten() if int(p) != SKIP]

    @property
    def num_objects(self) -> int:
        return sum(run.view.shape[0] for run in self._runs)

    def grouped(self) -> bool:
        """True when :meth:`pack_layers` / :meth:`unpack_layers` move several layers in one
        transfer (staged CUDA plans with torch's HBM kernels); else they loop per layer."""
        k = self.kernel
        return k.staged and k.pack_impl == k.unpack_impl == "auto"

    def _layer_runs(self, layer: int) -> list[_Run]:
        return self._runs if self._layer_groups is None else \
            self._groups[self._layer_groups[layer]]

    def _spans(self, first: int, count: int) -> list[tuple[int, int]]:
        """``(start, end)`` ranges of consecutive layers in ``first .. first + count - 1``
        that share their page ids (one range without ``layer_groups``): a grouped transfer
        moves one range, as each KV cache group has its own block table."""
        if self._layer_groups is None:
            return [(first, first + count)]
        spans: list[tuple[int, int]] = []
        for layer in range(first, first + count):
            if spans and self._layer_groups[layer] == self._layer_groups[spans[-1][0]]:
                spans[-1] = (spans[-1][0], layer + 1)
            else:
                spans.append((layer, layer + 1))
        return spans

    def pack_layers(self, first: int, kv_layers: Sequence[torch.Tensor]) -> None:
        """Layers ``first .. first + len(kv_layers) - 1`` at once: per run one 2-D DMA of
        all their spans (an object holds consecutive layers back to back), one HBM gather
        per layer (:func:`kvcentric.kernels.staged.staged_pack_layers`); with
        ``layer_groups``, one such transfer per range of layers of one group."""
        if not self.grouped() or len(kv_layers) == 1:
            for j, kv in enumerate(kv_layers):
                self.pack_layer(first + j, kv)
            return
        for start, end in self._spans(first, len(kv_layers)):
            kvs = kv_layers[start - first:end - first]
            for run in self._layer_runs(start):
                host = run.view[:, start:end].flatten(1)
                if run.masked:
                    for j, kv in enumerate(kvs):
                        self._pack_run(run, start + j, kv)
                else:
                    staged_pack_layers(kvs, run.flat_ids, host, block_dim=self.kernel.block_dim)

    def unpack_layers(self, first: int, kv_layers: Sequence[torch.Tensor]) -> None:
        """:meth:`pack_layers`'s inverse (SKIP pages left alone)."""
        if not self.grouped() or len(kv_layers) == 1:
            for j, kv in enumerate(kv_layers):
                self.unpack_layer(first + j, kv)
            return
        for start, end in self._spans(first, len(kv_layers)):
            kvs = kv_layers[start - first:end - first]
            for run in self._layer_runs(start):
                if not len(run.flat_ids):
                    continue  # every page of the run is the engine's own
                host = run.view[:, start:end].flatten(1)
                staged_unpack_layers(host, run.flat_ids, kvs, block_dim=self.kernel.block_dim,
                                     positions=run.positions)

    def pack_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        """Copy this layer's pages from ``kv_layer`` into the objects."""
        for run in self._layer_runs(layer):
            self._pack_run(run, layer, kv_layer)

    def _pack_run(self, run: _Run, layer: int, kv_layer: torch.Tensor) -> None:
        k = self.kernel
        if k.staged and not run.masked:
            staged_pack(kv_layer, run.flat_ids, run.view[:, layer].flatten(1),
                        block_dim=k.block_dim, impl=k.pack_impl)
            return
        for j in range(self.geometry.pages_per_object):
            self._move(run.view[:, layer, j], run.by_page[j], kv_layer, run.masked, pack=True,
                       key=(id(run), j))

    def unpack_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        """Copy this layer's pages from the objects into ``kv_layer`` (SKIP pages are
        left alone)."""
        k = self.kernel
        for run in self._layer_runs(layer):
            if k.staged and not len(run.flat_ids):
                continue  # every page of the run is the engine's own
            if k.staged:
                staged_unpack(run.view[:, layer].flatten(1), run.flat_ids, kv_layer,
                              block_dim=k.block_dim, impl=k.unpack_impl,
                              positions=run.positions)
                continue
            for j in range(self.geometry.pages_per_object):
                self._move(run.view[:, layer, j], run.by_page[j], kv_layer, run.masked,
                           pack=False, key=(id(run), j))

    def _move(self, rows: torch.Tensor, ids: torch.Tensor, kv_layer: torch.Tensor,
              masked: bool, pack: bool, key: tuple[int, int] | None = None) -> None:
        """Page ``ids`` of ``kv_layer`` to or from ``rows``; ``key`` (run, page): the same
        ids and rows shape for every layer, validated once per layer shape
        (:class:`kvcentric.kernels.PagedCopy`)."""
        if masked:
            keep = (ids != SKIP).nonzero().flatten().tolist()
            for r in keep:  # rare: the one object a local prefix hit covers in part
                self._move(rows[r:r + 1], ids[r:r + 1], kv_layer, False, pack)
            return
        k = self.kernel
        if key is None:
            if pack:
                kernels.pack_blocks(kv_layer, ids, rows, block_dim=k.block_dim,
                                    impl=k.pack_impl)
            else:
                kernels.unpack_blocks(rows, ids, kv_layer, block_dim=k.block_dim,
                                      impl=k.unpack_impl)
            return
        at = (*key, pack, tensor_sig(kv_layer))
        copy = self._copies.get(at)
        if copy is None:
            copy = kernels.PagedCopy(kv_layer, ids, rows, block_dim=k.block_dim,
                                     impl=k.pack_impl if pack else k.unpack_impl)
            self._copies[at] = copy
        if pack:
            copy.pack(kv_layer, rows)
        else:
            copy.unpack(rows, kv_layer)
