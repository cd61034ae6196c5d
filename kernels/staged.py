"""Pages between a CUDA layer and host objects through a device scratch buffer.

Why: a store object holds, per layer, its ``k`` pages as one contiguous span
(``[k, page_bytes]``), while the pages sit scattered in the paged cache. Moving them
page by page across PCIe costs either one small DMA per page or a kernel whose SMs issue
PCIe transactions (Triton over UVA); both stay far below the link's bandwidth. Here the
scatter/gather happens in HBM (a device-to-device gather, at HBM speed) and the PCIe
transfer is one 2-D DMA over every object span of the layer
(:mod:`kvcentric.kernels.strided_dma`; without the driver library, one ``copy_`` per
span), on the copy engines at the link's speed, leaving the SMs to the forward pass.

Shapes (``g`` objects of ``k`` pages; a page is one block of the layer, ``page_bytes``):

* ``kv_layer``: a CUDA KV layer, blocks on ``block_dim``, e.g. FlashAttention's
  ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (block dim 1);
* ``host``: uint8 ``[g, k * page_bytes]`` in host memory, each row contiguous, any row
  stride (objects inside the store's arena); pinned (page-locked or registered) for the
  copies to be asynchronous, else the driver stages them synchronously;
* ``ids``: 1-D int32/int64 block ids, ``ids[p]`` for page ``p`` of ``g * k`` (object
  ``p // k``); ``positions`` (unpack): which of the ``g * k`` pages to write, the pages
  named by ``ids`` (default: all, in order).

``impl="auto"`` gathers/scatters in HBM with one torch index op per call (ids
trusted, as the connector's plan makes them); another impl goes through the validating
:func:`kvcentric.kernels.pack_blocks` / ``unpack_blocks`` with that implementation.

Everything is enqueued on the current stream; the device scratch (one layer's pages,
``g * k * page_bytes``) comes from the caching allocator on that stream, so it is reused
only behind these copies. The caller synchronises before reading ``host`` (pack) or
reusing it (unpack). Bit-exact: bytes move, nothing is converted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcentric.kernels import strided_dma
from kvcentric.kernels.dispatch import BlockIds, pack_blocks, unpack_blocks
from kvcentric.kernels.tensor_views import INT_BY_SIZE, block_shape, check_block_dim


def staged_pack(kv_layer: torch.Tensor, ids: BlockIds, host: torch.Tensor, *,
                block_dim: int = 0, impl: str = "auto") -> None:
    """``host[i]`` = pages ``ids[i*k:(i+1)*k]`` of ``kv_layer``, back to back."""
    page = _page_bytes(kv_layer, block_dim)
    pages = host.shape[0] * _pages_per_row(page, host)
    if len(ids) != pages:
        raise ValueError(f"{len(ids)} block ids for {pages} pages")
    scratch = _scratch(kv_layer, page, pages)
    if impl == "auto":
        _gather(kv_layer, _device_ids(ids, kv_layer), scratch, block_dim)
    else:
        pack_blocks(kv_layer, ids, scratch, block_dim=block_dim, impl=impl)
    _dma(host, scratch.view(host.shape[0], -1))


def staged_unpack(host: torch.Tensor, ids: BlockIds, kv_layer: torch.Tensor, *,
                  block_dim: int = 0, impl: str = "auto",
                  positions: torch.Tensor | None = None) -> None:
    """Write page ``positions[j]`` of ``host`` (object ``positions[j] // k``) into block
    ``ids[j]`` of ``kv_layer``; other blocks are untouched."""
    page = _page_bytes(kv_layer, block_dim)
    pages = host.shape[0] * _pages_per_row(page, host)
    if positions is None and len(ids) != pages:
        raise ValueError(f"{len(ids)} block ids for {pages} pages: pass positions")
    if positions is not None and (positions.dim() != 1 or len(positions) != len(ids)):
        raise ValueError("positions must be 1-D with one entry per block id")
    scratch = _scratch(kv_layer, page, pages)
    _dma(scratch.view(host.shape[0], -1), host)
    if positions is not None:
        scratch = scratch.index_select(0, positions.to(scratch.device, non_blocking=True))
    if impl == "auto":
        _scatter(scratch, _device_ids(ids, kv_layer), kv_layer, block_dim)
    else:
        unpack_blocks(scratch, ids, kv_layer, block_dim=block_dim, impl=impl)


def staged_pack_layers(kv_layers: Sequence[torch.Tensor], ids: BlockIds, host: torch.Tensor,
                       *, block_dim: int = 0) -> None:
    """:func:`staged_pack` of ``L = len(kv_layers)`` consecutive layers at once: ``host``
    is uint8 ``[g, L * k * page_bytes]`` (each row: the layers' spans of one object, back
    to back, as objects lay them out); the pages of every layer are gathered into one
    scratch, reordered object-major in HBM, and cross PCIe as one 2-D DMA. Per layer only
    one index op remains: small layers (MLA) no longer pay a DMA call, a stream switch and
    an event per layer. ``impl="auto"`` only."""
    page, g, per = _layers_geometry(kv_layers, block_dim, host)
    scratch = _scratch(kv_layers[0], page, len(kv_layers) * g * (per // page))
    by_layer = scratch.view(len(kv_layers), -1, page)
    dev_ids = _device_ids(ids, kv_layers[0])
    if len(dev_ids) != by_layer.shape[1]:
        raise ValueError(f"{len(dev_ids)} block ids for {by_layer.shape[1]} pages")
    for j, kv in enumerate(kv_layers):
        _gather(kv, dev_ids, by_layer[j], block_dim)
    objects = by_layer.view(len(kv_layers), g, per).transpose(0, 1).contiguous()
    _dma(host, objects.view(g, -1))


def staged_unpack_layers(host: torch.Tensor, ids: BlockIds, kv_layers: Sequence[torch.Tensor],
                         *, block_dim: int = 0, positions: torch.Tensor | None = None) -> None:
    """:func:`staged_unpack` of ``L = len(kv_layers)`` consecutive layers at once (``host``
    as in :func:`staged_pack_layers`): one 2-D DMA brings every layer's spans into HBM,
    one device copy reorders them layer-major, then one index op per layer scatters its
    pages (``positions``: as in :func:`staged_unpack`). ``impl="auto"`` only."""
    page, g, per = _layers_geometry(kv_layers, block_dim, host)
    scratch = _scratch(kv_layers[0], page, len(kv_layers) * g * (per // page))
    _dma(scratch.view(g, -1), host)
    by_layer = scratch.view(g, len(kv_layers), per).transpose(0, 1).contiguous().view(
        len(kv_layers), -1, page)
    dev_ids = _device_ids(ids, kv_layers[0])
    if positions is None and len(dev_ids) != by_layer.shape[1]:
        raise ValueError(f"{len(dev_ids)} block ids for {by_layer.shape[1]} pages: pass "
                         f"positions")
    pos = positions.to(scratch.device, non_blocking=True) if positions is not None else None
    for j, kv in enumerate(kv_layers):
        rows = by_layer[j] if pos is None else by_layer[j].index_select(0, pos)
        _scatter(rows, dev_ids, kv, block_dim)


def _layers_geometry(kv_layers: Sequence[torch.Tensor], block_dim: int,
                     host: torch.Tensor) -> tuple[int, int, int]:
    """(page bytes, objects, bytes per object and layer) of a multi-layer staged copy."""
    if not kv_layers:
        raise ValueError("no layers to copy")
    page = _page_bytes(kv_layers[0], block_dim)
    if any(_page_bytes(kv, block_dim) != page or kv.device != kv_layers[0].device
           for kv in kv_layers):
        raise ValueError("every layer of a multi-layer copy has the same pages and device")
    per_row = _pages_per_row(page, host)
    if per_row % len(kv_layers):
        raise ValueError(f"{per_row} pages per host row is not {len(kv_layers)} layers' worth")
    return page, host.shape[0], per_row // len(kv_layers) * page


def _device_ids(ids: BlockIds, kv_layer: torch.Tensor) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        ids = torch.tensor(list(ids), dtype=torch.int64)
    if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1:
        raise ValueError(f"block ids must be a 1-D int32/int64 tensor, got {ids.dtype} "
                         f"{tuple(ids.shape)}")
    return ids.to(kv_layer.device, torch.int64, non_blocking=True)  # index_copy_: int64


def _typed_pair(kv_layer: torch.Tensor, scratch: torch.Tensor,
                block_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer and the scratch rows ``[n, *rest]`` as same-width integers (bit-exact
    for every dtype; index kernels exist for all of them)."""
    as_int = INT_BY_SIZE[kv_layer.element_size()]
    rest = block_shape(kv_layer.shape, check_block_dim(kv_layer.shape, block_dim))
    return kv_layer.view(as_int), scratch.view(as_int).view(scratch.shape[0], *rest)


def _gather(kv_layer: torch.Tensor, ids: torch.Tensor, scratch: torch.Tensor,
            block_dim: int) -> None:
    """scratch[i] = block ids[i] (HBM to HBM). The generic :func:`pack_blocks` validates
    and plans per call (hundreds of Python calls); this runs one torch op, since
    the staged path calls it per layer on the step's critical path. Ids are trusted
    (the caller's plan; an id out of range is a device-side assert)."""
    src, rows = _typed_pair(kv_layer, scratch, block_dim)
    torch.index_select(src, block_dim, ids, out=rows.movedim(0, block_dim))


def _scatter(scratch: torch.Tensor, ids: torch.Tensor, kv_layer: torch.Tensor,
             block_dim: int) -> None:
    """Block ids[i] = scratch[i] (HBM to HBM); see :func:`_gather`."""
    dst, rows = _typed_pair(kv_layer, scratch, block_dim)
    dst.index_copy_(block_dim, ids, rows.movedim(0, block_dim))


def _dma(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[i] = src[i]`` for every row (2-D uint8, rows contiguous; one side on the
    GPU, the other in host memory), enqueued on the current stream."""
    height, width = src.shape
    if not height:
        return
    if not strided_dma.available():
        for i in range(height):
            dst[i].copy_(src[i], non_blocking=True)
        return
    gpu = dst.device if dst.device.type == "cuda" else src.device
    stream = torch.cuda.current_stream(gpu).cuda_stream
    strided_dma.copy_rows(_rows(dst), _rows(src), width, height, stream,
                          gpu.index if gpu.index is not None else torch.cuda.current_device())


def _rows(t: torch.Tensor) -> strided_dma.Rows:
    pitch = t.stride(0) if t.shape[0] > 1 else t.shape[1]
    return strided_dma.Rows(t.data_ptr(), pitch, t.device.type == "cuda")


def _page_bytes(kv_layer: torch.Tensor, block_dim: int) -> int:
    dim = check_block_dim(kv_layer.shape, block_dim)
    return kv_layer.numel() // kv_layer.shape[dim] * kv_layer.element_size()


def _pages_per_row(page_bytes: int, host: torch.Tensor) -> int:
    if host.dtype != torch.uint8 or host.dim() != 2 or host.device.type != "cpu":
        raise ValueError(f"host must be a 2-D uint8 CPU tensor, got {tuple(host.shape)} "
                         f"{host.dtype} on {host.device}")
    if host.shape[0] and host.stride(1) != 1:
        raise ValueError("every host row must be contiguous")
    if host.shape[1] % page_bytes:
        raise ValueError(f"host rows of {host.shape[1]} B are not whole {page_bytes}-byte "
                         f"pages")
    return host.shape[1] // page_bytes


def _scratch(kv_layer: torch.Tensor, page_bytes: int, pages: int) -> torch.Tensor:
    """``[pages, page_bytes]`` uint8 on the layer's device (the caching allocator, on
    the current stream)."""
    if kv_layer.device.type != "cuda":
        raise ValueError(f"staged copies need a CUDA layer, got one on {kv_layer.device}")
    return torch.empty((pages, page_bytes), dtype=torch.uint8, device=kv_layer.device)
