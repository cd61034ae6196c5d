"""Torch implementation of block pack/unpack: the reference and the CPU data path.

The functions here take already-validated arguments (see ``kernels.dispatch``):

* ``groups``: :class:`kvcentric.kernels.tensor_views.LayerGroup` views, each
  ``[layers_in_group, *layer_shape]``, block dim at ``1 + block_dim``;
* ``ids``: 1-D int32/int64 tensor on the layers' device, every id in range;
* ``rows``: ``[n, num_layers, *rest]`` of the layer dtype, rows contiguous.

They never allocate a copy of the KV data on the fast path: pack writes
straight into ``rows`` with ``torch.index_select(..., out=...)`` and unpack
uses ``index_copy_`` on the layer. Tensors are viewed as wide integers first
(:func:`kvcentric.kernels.tensor_views.widen_pair`), which is bit-exact and lets one element
carry up to 8 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcentric.kernels.tensor_views import INT_BY_SIZE, LayerGroup, widen_pair


def pack_reference(kv_layer: torch.Tensor, block_ids: torch.Tensor, block_dim: int) -> torch.Tensor:
    """The defining semantics of ``pack_blocks``, returning a new tensor
    ``[len(block_ids), *rest]``: ``index_select`` then move the block dim first."""
    return kv_layer.index_select(block_dim, block_ids).movedim(block_dim, 0)


def unpack_reference(
    packed: torch.Tensor, block_ids: torch.Tensor, kv_layer: torch.Tensor, block_dim: int
) -> torch.Tensor:
    """The defining semantics of ``unpack_blocks``: returns a new tensor equal to
    ``kv_layer`` with block ``block_ids[i]`` replaced by ``packed[i]``."""
    result = kv_layer.clone()
    as_int = INT_BY_SIZE[result.element_size()]  # index_copy_ lacks fp8 kernels
    source = packed.movedim(0, block_dim).view(as_int)
    result.view(as_int).index_copy_(block_dim, block_ids.long(), source)
    return result


def torch_pack(
    groups: Sequence[LayerGroup], ids: torch.Tensor, rows: torch.Tensor, block_dim: int
) -> None:
    """Gather block ``ids[i]`` of every layer into ``rows[i]`` (in place).

    ``rows`` may be host memory while the layers are on CUDA; the gathered
    blocks then go through one device-side temporary and a device-to-host copy.
    """
    dim = 1 + block_dim
    for group in groups:
        count = group.tensor.shape[0]
        dst = rows[:, group.first : group.first + count].movedim(0, dim)
        src, dst = widen_pair(group.tensor, dst, dim)
        if dst.device == src.device:
            torch.index_select(src, dim, ids, out=dst)
        else:
            dst.copy_(torch.index_select(src, dim, ids))


def torch_unpack(
    rows: torch.Tensor, ids: torch.Tensor, groups: Sequence[LayerGroup], block_dim: int
) -> None:
    """Scatter ``rows[i]`` into block ``ids[i]`` of every layer (in place).

    Only the listed blocks are written. Host ``rows`` with CUDA layers are
    first copied to the device (one temporary of the packed size).
    """
    dim = 1 + block_dim
    index = ids.long()
    for group in groups:
        count = group.tensor.shape[0]
        src = rows[:, group.first : group.first + count].movedim(0, dim)
        dst, src = widen_pair(group.tensor, src, dim)
        if src.device != dst.device:
            src = src.to(dst.device)
        dst.index_copy_(dim, index, src)
