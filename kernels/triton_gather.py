"""Triton gather (pack) and scatter (unpack) kernels plus their launchers.

Importing this module does not import Triton: the ``@triton.jit`` kernels
live in ``kernels.triton_kernels``, imported on the first launch
(:func:`_kernels`). Arguments arrive validated from ``kernels.dispatch``
(same conventions as ``kernels.reference``):

* ``groups``: :class:`kvcentric.kernels.tensor_views.LayerGroup` views ``[Lg, *layer_shape]``
  with the block dim at ``1 + block_dim``;
* ``ids``: 1-D int32/int64 tensor on the layers' device, ids in range;
* ``rows``: ``[n, num_layers, *rest]`` of the layer dtype, each row contiguous;
  on CUDA it may also be pinned host memory (written/read through UVA).

Kernel geometry (details in ``kernels.triton_kernels``): a *slice* is the
block of one layer, ``rest``-shaped. Its dims are merged where strides allow;
up to four remaining dims with arbitrary strides are addressed (three outer
row dims and an inner run), so strided layers (slices of bigger tensors,
padded strides, the K/V dim of the flash layout) need no copy. One program
copies an ``[R, C]`` tile (rows x inner run) of one (block id, layer) slice.
Data moves as same-width (or wider) integers, so every dtype, bf16 and fp8
included, is copied bit-exactly, also under ``TRITON_INTERPRET=1`` (which
cannot do bf16 arithmetic).

Launches are asynchronous on CUDA: the caller synchronises the current stream
before reading pinned host ``rows`` or reusing them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcentric.kernels.tensor_views import LayerGroup, widen_pair

MAX_DIMS = 4  # slice dims (after merging) one kernel addresses: 3 outer + inner
MAX_TILES = 65535  # CUDA limit of grid axis 1
MAX_PROGRAMS = 2**31 - 1  # CUDA limit of grid axis 0
TILE_BYTES = 16384  # bytes one GPU program moves (upper bound)
INTERPRET_TILE_BYTES = 1 << 20  # the interpreter pays per program: big tiles
MAX_TILE = 1 << 16  # elements per tile; slices needing more fall back to torch


@dataclass(frozen=True)
class _Launch:
    """One kernel launch: a layer group against its slice of the rows.

    ``src`` is ``[Lg, *layer_shape]`` and ``rows`` ``[n, Lg, *rest]``, both as
    integer views. One slice (block of one layer) is ``outer`` rows
    (``[(size, stride)] * 3``, leading unused dims ``(1, 0)``) of ``inner``
    elements at ``inner_stride``; tiles are ``[tile_rows, tile_cols]``.
    """

    src: torch.Tensor
    rows: torch.Tensor
    dim: int
    outer: tuple[tuple[int, int], ...]
    inner: tuple[int, int]
    tile_rows: int
    tile_cols: int
    col_tiles: int
    tiles: int


def unsupported_reason(
    groups: Sequence[LayerGroup], rows: torch.Tensor, block_dim: int, interpret: bool
) -> str | None:
    """Why the Triton path cannot take these tensors, or None if it can."""
    for group in groups:
        plan = _plan(group, rows, block_dim, interpret)
        if isinstance(plan, str):
            return plan
    return None


def triton_pack(
    groups: Sequence[LayerGroup],
    ids: torch.Tensor,
    rows: torch.Tensor,
    block_dim: int,
    interpret: bool,
) -> None:
    """Gather block ``ids[i]`` of every layer into ``rows[i]`` with Triton."""
    gather, _ = _kernels()
    for group in groups:
        _launch(gather, _checked_plan(group, rows, block_dim, interpret), ids)


def triton_unpack(
    rows: torch.Tensor,
    ids: torch.Tensor,
    groups: Sequence[LayerGroup],
    block_dim: int,
    interpret: bool,
) -> None:
    """Scatter ``rows[i]`` into block ``ids[i]`` of every layer with Triton."""
    _, scatter = _kernels()
    for group in groups:
        _launch(scatter, _checked_plan(group, rows, block_dim, interpret), ids)


def _checked_plan(
    group: LayerGroup, rows: torch.Tensor, block_dim: int, interpret: bool
) -> _Launch:
    plan = _plan(group, rows, block_dim, interpret)
    if isinstance(plan, str):
        raise ValueError(f"Triton path cannot copy these tensors: {plan}")
    return plan


def _plan(group: LayerGroup, rows: torch.Tensor, block_dim: int, interpret: bool) -> _Launch | str:
    """Build the launch description for one group, or return a fallback reason."""
    dim = 1 + block_dim
    count = group.tensor.shape[0]
    part = rows[:, group.first : group.first + count]
    reason = _device_reason(group.tensor, part, interpret)
    if reason:
        return reason
    src, moved = widen_pair(group.tensor, part.movedim(0, dim), dim)
    if src.element_size() not in (1, 2, 4, 8):
        return f"element size {src.element_size()} has no integer type"
    slice_shape = src.shape[1:dim] + src.shape[dim + 1 :]
    slice_strides = src.stride()[1:dim] + src.stride()[dim + 1 :]
    dims = _merge_dims(tuple(slice_shape), tuple(slice_strides))
    if len(dims) > MAX_DIMS:
        return f"a block needs {len(dims)} strided dims after merging, at most {MAX_DIMS} fit"
    outer = tuple([(1, 0)] * (MAX_DIMS - len(dims)) + dims[:-1])
    n_rows = outer[0][0] * outer[1][0] * outer[2][0]
    tiling = _tiling(n_rows, dims[-1][0], src.element_size(), interpret)
    if tiling is None or rows.shape[0] * count > MAX_PROGRAMS or n_rows * dims[-1][0] >= 2**31:
        return f"grid too large ({rows.shape[0]} x {count} blocks of {n_rows} x {dims[-1][0]})"
    tile_rows, tile_cols, col_tiles, tiles = tiling
    return _Launch(
        src, moved.movedim(dim, 0), dim, outer, dims[-1], tile_rows, tile_cols, col_tiles, tiles
    )


def _device_reason(src: torch.Tensor, rows: torch.Tensor, interpret: bool) -> str | None:
    if interpret:
        return None
    if src.device.type != "cuda":
        return f"layers on {src.device} need TRITON_INTERPRET=1 for Triton"
    if rows.device.type == "cpu" and not rows.is_pinned():
        return "host rows are not pinned, so the GPU cannot address them"
    return None


def _merge_dims(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[tuple[int, int]]:
    """Drop size-1 dims and merge neighbours that form one strided run."""
    merged: list[tuple[int, int]] = []
    for size, stride in zip(shape, strides, strict=True):
        if size == 1:
            continue
        if merged and merged[-1][1] == size * stride:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    return merged or [(1, 1)]


def _tiling(
    n_rows: int, inner: int, elem: int, interpret: bool
) -> tuple[int, int, int, int] | None:
    """``(tile_rows, tile_cols, col_tiles, tiles)`` for one slice, or None.

    Tiles are powers of two of at most ``TILE_BYTES`` (GPU) or
    ``INTERPRET_TILE_BYTES`` (the interpreter runs one numpy pass per program),
    grown when a slice would need more than ``MAX_TILES`` tiles.
    """
    cap_bytes = INTERPRET_TILE_BYTES if interpret else TILE_BYTES
    cap = min(max(_prev_pow2(cap_bytes // elem), 16), MAX_TILE)
    while True:
        cols = min(_next_pow2(inner), cap)
        rows = min(_next_pow2(n_rows), max(cap // cols, 1))
        col_tiles = -(-inner // cols)
        tiles = col_tiles * -(-n_rows // rows)
        if tiles <= MAX_TILES:
            return rows, cols, col_tiles, tiles
        if cap >= MAX_TILE:
            return None
        cap *= 2


def _prev_pow2(value: int) -> int:
    return 1 << (max(value, 1).bit_length() - 1)


def _next_pow2(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


def _launch(kernel: Any, plan: _Launch, ids: torch.Tensor) -> None:
    """Launch ``kernel`` for one plan on the layers' device (current stream)."""
    n, count = plan.rows.shape[0], plan.src.shape[0]
    if n == 0 or plan.src.numel() == 0:
        return
    (s0, st0), (s1, st1), (s2, st2) = plan.outer
    inner, inner_stride = plan.inner
    args = (
        plan.src,
        ids,
        plan.rows,
        count,
        s0 * s1 * s2 * inner,
        plan.src.stride(plan.dim),
        plan.src.stride(0),
        plan.rows.stride(0),
        s0 * s1 * s2,
        s1,
        s2,
        st0,
        st1,
        st2,
        inner,
        inner_stride,
        plan.col_tiles,
    )
    tile_bytes = plan.tile_rows * plan.tile_cols * plan.src.element_size()
    meta = {"R": plan.tile_rows, "C": plan.tile_cols, "num_warps": 4 if tile_bytes <= 4096 else 8}
    grid = (n * count, plan.tiles)
    if plan.src.device.type == "cuda":
        with torch.cuda.device(plan.src.device):
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


def _kernels() -> tuple[Any, Any]:
    """The jit kernels; the first call imports Triton (Python caches the module)."""
    from kvcentric.kernels import triton_kernels

    return triton_kernels.gather_kernel, triton_kernels.scatter_kernel
