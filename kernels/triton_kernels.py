"""The ``@triton.jit`` gather/scatter kernels (imports Triton at import time).

Only ``kernels.triton_gather`` imports this module, lazily, so importing
``kernels`` never needs Triton. Pointers are integer views of the tensors
(int8/16/32/64), so copies are bit-exact for every dtype and need no float
arithmetic (the interpreter has no bf16 arithmetic).

One *slice* is one block of one layer: ``n_rows`` outer rows (up to three
strided dims ``[s0, s1, s2]``, strides ``st0..st2``; ``s0`` is implied) of
``inner`` elements at stride ``inner_stride`` (1 unless the layout is odd).
In the packed rows a slice is ``numel = n_rows * inner`` contiguous elements.

Arguments shared by both kernels:

* ``src``: layer group ``[Lg, *layer_shape]``; ``blk_stride``/``layer_stride``
  are its block-dim and layer-dim strides (elements);
* ``ids``: ``[n]`` int32/int64 block ids;
* ``rows``: packed rows, row ``i`` at ``i * row_stride`` holding ``Lg``
  contiguous slices of ``numel`` elements.

Grid: ``(n * Lg, row_tiles * col_tiles)``; program ``(p, t)`` copies an
``[R, C]`` tile (outer rows x inner elements) of layer ``p % Lg`` of block
``ids[p // Lg]``. The inner dim is contiguous in both tensors, so loads and
stores vectorise; only the ``R`` row indices need div/mod.
"""

import triton
import triton.language as tl


@triton.jit
def _tile_offsets(
    t,
    n_rows,
    s1,
    s2,
    st0,
    st1,
    st2,
    inner,
    inner_stride,
    col_tiles,
    R: tl.constexpr,
    C: tl.constexpr,
):
    """(source offsets, packed offsets, mask) of tile ``t`` of one slice, each ``[R, C]``."""
    r = (t // col_tiles) * R + tl.arange(0, R)
    c = (t % col_tiles) * C + tl.arange(0, C)
    row_off = (r % s2).to(tl.int64) * st2
    row_off += ((r // s2) % s1).to(tl.int64) * st1
    row_off += (r // (s1 * s2)).to(tl.int64) * st0
    src_off = row_off[:, None] + c[None, :].to(tl.int64) * inner_stride
    dst_off = r[:, None] * inner + c[None, :]
    mask = (r[:, None] < n_rows) & (c[None, :] < inner)
    return src_off, dst_off, mask


@triton.jit
def gather_kernel(
    src,
    ids,
    rows,
    n_layers,
    numel,
    blk_stride,
    layer_stride,
    row_stride,
    n_rows,
    s1,
    s2,
    st0,
    st1,
    st2,
    inner,
    inner_stride,
    col_tiles,
    R: tl.constexpr,
    C: tl.constexpr,
):
    """rows[i, layer] (flat slice) = slice of block ids[i] of src[layer]."""
    pid = tl.program_id(0)
    i = (pid // n_layers).to(tl.int64)
    layer = (pid % n_layers).to(tl.int64)
    src_off, dst_off, mask = _tile_offsets(
        tl.program_id(1), n_rows, s1, s2, st0, st1, st2, inner, inner_stride, col_tiles, R, C
    )
    blk = tl.load(ids + i).to(tl.int64)
    src_base = src + blk * blk_stride + layer * layer_stride
    dst_base = rows + i * row_stride + layer * numel
    tl.store(dst_base + dst_off, tl.load(src_base + src_off, mask=mask), mask=mask)


@triton.jit
def scatter_kernel(
    src,
    ids,
    rows,
    n_layers,
    numel,
    blk_stride,
    layer_stride,
    row_stride,
    n_rows,
    s1,
    s2,
    st0,
    st1,
    st2,
    inner,
    inner_stride,
    col_tiles,
    R: tl.constexpr,
    C: tl.constexpr,
):
    """Slice of block ids[i] of src[layer] = rows[i, layer] (flat slice)."""
    pid = tl.program_id(0)
    i = (pid // n_layers).to(tl.int64)
    layer = (pid % n_layers).to(tl.int64)
    src_off, dst_off, mask = _tile_offsets(
        tl.program_id(1), n_rows, s1, s2, st0, st1, st2, inner, inner_stride, col_tiles, R, C
    )
    blk = tl.load(ids + i).to(tl.int64)
    src_base = src + blk * blk_stride + layer * layer_stride
    dst_base = rows + i * row_stride + layer * numel
    tl.store(src_base + src_off, tl.load(dst_base + dst_off, mask=mask), mask=mask)
