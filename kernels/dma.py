"""Per-page copies: one ``copy_`` (on CUDA: one ``cudaMemcpyAsync``) per contiguous piece.

The alternative to a gather kernel when pages are big: a DMA engine moves a contiguous
page between HBM and pinned host memory without occupying SMs, while a kernel reading
host memory through UVA issues PCIe reads from the SMs. Each page still costs a launch;
the connector's CUDA path moves whole object spans instead (:mod:`kvcentric.kernels.staged`).

Arguments are validated by :mod:`kvcentric.kernels.dispatch`:

* ``groups``: :class:`~kvcentric.kernels.tensor_views.LayerGroup` views
  ``[layers_in_group, *layer_shape]``;
* ``ids``: block ids as Python ints (no device round trip per id);
* ``rows``: ``[n, num_layers, *rest]`` of the layer dtype, each row contiguous; on CUDA
  layers it may be host memory, ideally pinned (pageable memory makes every copy a
  synchronous, driver-staged one).

A block of one layer, e.g. FlashAttention's ``[2, block_size, num_kv_heads, head_dim]``
slice of ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, is split into its
contiguous pieces (two there: K and V); a block with more than :data:`MAX_PIECES` pieces
is copied with one strided ``copy_`` instead. Copies are enqueued on the current stream
and not synchronised (``non_blocking``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from kvcentric.kernels.tensor_views import LayerGroup

MAX_PIECES = 16  # beyond this, per-piece launch costs exceed one strided copy


def pieces(block: torch.Tensor, row: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs ``(block part, row part)`` covering ``block``, each block part contiguous
    (``row`` is contiguous and has ``block``'s shape). Splits leading dims only while
    needed; yields ``(block, row)`` whole when it cannot be split into few pieces."""
    if block.is_contiguous() or _count(block) > MAX_PIECES:
        yield block, row
        return
    for k in range(block.shape[0]):
        yield from pieces(block[k], row[k])


def _count(block: torch.Tensor) -> int:
    """How many contiguous pieces splitting leading dims of ``block`` gives."""
    count = 1
    for d in range(block.dim()):
        if block[(0,) * d].is_contiguous():
            return count
        count *= block.shape[d]
    return count


def _pairs(groups: Sequence[LayerGroup], ids: Sequence[int], rows: torch.Tensor,
           block_dim: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for i, block_id in enumerate(ids):
        for group in groups:
            for j in range(group.tensor.shape[0]):
                block = group.tensor[j].select(block_dim, block_id)
                yield from pieces(block, rows[i, group.first + j])


def dma_pack(groups: Sequence[LayerGroup], ids: Sequence[int], rows: torch.Tensor,
             block_dim: int) -> None:
    """``rows[i, l]`` = block ``ids[i]`` of layer ``l``, one copy per contiguous piece."""
    for block, row in _pairs(groups, ids, rows, block_dim):
        row.copy_(block, non_blocking=True)


def dma_unpack(rows: torch.Tensor, ids: Sequence[int], groups: Sequence[LayerGroup],
               block_dim: int) -> None:
    """Block ``ids[i]`` of layer ``l`` = ``rows[i, l]``, one copy per contiguous piece."""
    for block, row in _pairs(groups, ids, rows, block_dim):
        block.copy_(row, non_blocking=True)
