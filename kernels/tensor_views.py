"""Input validation and tensor-geometry helpers shared by every copy path.

Nothing here moves KV data; these helpers only check arguments and build views.
Every check failure raises ``ValueError`` with a message naming the argument.

Vocabulary used throughout ``kernels``:

* *layer*: one paged KV-cache tensor of vLLM, e.g. NHD
  ``[num_blocks, block_size, num_kv_heads, head_dim]`` or flash-attn
  ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; its block dimension
  is ``block_dim``.
* *block shape* (``rest``): the layer shape without ``block_dim``.
* *rows*: the packed side, ``[n, num_layers, *rest]``; row ``i`` holds block
  ``block_ids[i]`` of every layer and must be one contiguous span of memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

INT_BY_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class LayerGroup:
    """Consecutive layers that live in one storage at a uniform element stride.

    ``tensor`` is ``[num_layers_in_group, *layer_shape]`` (a view, never a copy);
    ``first`` is the index of its first layer in the caller's layer list.
    """

    first: int
    tensor: torch.Tensor


def check_block_dim(shape: torch.Size, block_dim: int) -> int:
    """Return ``block_dim`` normalised to ``[0, ndim)``; ValueError if out of range."""
    ndim = len(shape)
    if not isinstance(block_dim, int) or isinstance(block_dim, bool):
        raise ValueError(f"block_dim must be an int, got {type(block_dim).__name__}")
    if not -ndim <= block_dim < ndim:
        raise ValueError(f"block_dim={block_dim} is out of range for a {ndim}-D layer")
    return block_dim % ndim


def block_shape(shape: torch.Size, block_dim: int) -> tuple[int, ...]:
    """Layer shape without its block dim: the shape of one block (``rest``)."""
    return tuple(shape[:block_dim]) + tuple(shape[block_dim + 1 :])


def check_layers(layers: Sequence[torch.Tensor], what: str = "layers") -> None:
    """ValueError unless ``layers`` is a non-empty sequence of tensors that agree
    in shape, dtype and device."""
    if isinstance(layers, torch.Tensor) or len(layers) == 0:
        raise ValueError(f"{what} must be a non-empty sequence of tensors")
    first = layers[0]
    for idx, layer in enumerate(layers):
        if not isinstance(layer, torch.Tensor):
            raise ValueError(f"{what}[{idx}] is {type(layer).__name__}, not a tensor")
        if layer.dim() == 0:
            raise ValueError(f"{what}[{idx}] is 0-D; a KV layer needs a block dim")
        if layer.shape != first.shape:
            raise ValueError(
                f"{what}[{idx}] has shape {tuple(layer.shape)}, {what}[0] has {tuple(first.shape)}"
            )
        if layer.dtype != first.dtype:
            raise ValueError(f"{what}[{idx}] has dtype {layer.dtype}, {what}[0] has {first.dtype}")
        if layer.device != first.device:
            raise ValueError(f"{what}[{idx}] is on {layer.device}, {what}[0] is on {first.device}")


def normalize_ids(
    block_ids: torch.Tensor | Sequence[int], num_blocks: int, device: torch.device,
    move: bool = True,
) -> torch.Tensor:
    """Validate block ids and return them as a 1-D int32/int64 tensor on ``device``.

    Accepts a 1-D int32/int64 tensor (CPU or ``device``, any stride; the
    result is contiguous) or a sequence of ints (made int64). Every id must
    lie in ``[0, num_blocks)``. Ids on a CUDA device cost one device sync for
    the range check; host ids are checked on the host and moved without a sync
    (``move=False``: left where they are). Duplicates are allowed for
    packing; for unpacking they leave it unspecified which row wins.
    """
    if not isinstance(block_ids, torch.Tensor):
        try:
            values = list(block_ids)
            block_ids = torch.tensor(values) if values else torch.empty(0, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"block_ids must be ints: {exc}") from exc
    ids = block_ids
    if ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_ids must be int32 or int64, got {ids.dtype}")
    if ids.device.type != "cpu" and ids.device != device:
        raise ValueError(f"block_ids are on {ids.device}, the KV layer is on {device}")
    if ids.numel():
        lo, hi = torch.stack([ids.min(), ids.max()]).tolist()
        if lo < 0:
            raise ValueError(f"block_ids contains a negative id ({lo})")
        if hi >= num_blocks:
            raise ValueError(f"block_ids contains id {hi}, but the layer has {num_blocks} blocks")
    return (ids.to(device, non_blocking=True) if move else ids).contiguous()


def check_out_device(rows: torch.Tensor, layer_device: torch.device, what: str) -> None:
    """Rows live on the layer's device, or in host memory when the layer is on CUDA."""
    if rows.device == layer_device:
        return
    if rows.device.type == "cpu" and layer_device.type == "cuda":
        return
    raise ValueError(f"{what} is on {rows.device}, the KV layer is on {layer_device}")


def as_rows(
    buf: torch.Tensor, n: int, row_shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """View a uint8 byte buffer as ``[n, *row_shape]`` of ``dtype`` (no copy).

    ``buf`` is either 1-D with exactly ``n * row_bytes`` contiguous bytes, or has
    ``n`` leading rows of ``row_bytes`` bytes each, every row contiguous (the row
    stride may be larger, e.g. objects inside a slab). The returned view aliases
    ``buf``: the caller keeps ownership of the memory. ValueError on a size,
    dtype, contiguity or alignment mismatch.
    """
    if buf.dtype != torch.uint8:
        raise ValueError(f"as_rows needs a uint8 buffer, got {buf.dtype}")
    shape = tuple(int(s) for s in row_shape)
    elem = torch.empty((), dtype=dtype).element_size()
    row_bytes = elem * _numel(shape)
    if buf.dim() == 1:
        if buf.numel() != n * row_bytes:
            raise ValueError(f"buffer has {buf.numel()} bytes, expected {n} x {row_bytes}")
        buf = buf.view(n, row_bytes) if buf.is_contiguous() else _bad_rows(buf, "not contiguous")
    if buf.shape[0] != n or _numel(buf.shape[1:]) != row_bytes:
        raise ValueError(
            f"byte buffer of shape {tuple(buf.shape)} does not hold {n} rows of {row_bytes} bytes"
        )
    flat = buf.flatten(1) if _row_contiguous(buf) else _bad_rows(buf, "rows are not contiguous")
    try:
        typed = flat.view(dtype)
    except RuntimeError as exc:
        raise ValueError(f"byte buffer is not aligned for {dtype}: {exc}") from exc
    return typed.view(n, *shape)


def rows_view(
    out: torch.Tensor, n: int, row_shape: tuple[int, ...], dtype: torch.dtype, what: str
) -> torch.Tensor:
    """Return ``out`` as ``[n, *row_shape]`` of ``dtype`` with contiguous rows.

    Accepted: exactly that shape and dtype, or a uint8 byte view with the same
    bytes per row (see :func:`as_rows`). Anything else raises ValueError.
    """
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{what} must be a tensor, got {type(out).__name__}")
    if out.dtype == dtype and tuple(out.shape) == (n, *row_shape):
        if not _row_contiguous(out):
            raise ValueError(f"{what}: every row {what}[i] must be contiguous")
        return out
    if out.dtype == torch.uint8:
        return as_rows(out, n, row_shape, dtype)
    if out.dtype != dtype:
        raise ValueError(f"{what} has dtype {out.dtype}, expected {dtype} or a uint8 byte view")
    raise ValueError(f"{what} has shape {tuple(out.shape)}, expected {(n, *row_shape)}")


def group_layers(layers: Sequence[torch.Tensor]) -> list[LayerGroup]:
    """Express the layers as few strided views as possible, without copying.

    If all layers share one storage and sit at a uniform positive element
    distance (one big allocation split per layer), the result is a single
    ``[num_layers, *layer_shape]`` view; otherwise one group per layer.
    """
    first = layers[0]
    singles = [LayerGroup(i, t.unsqueeze(0)) for i, t in enumerate(layers)]
    if len(layers) == 1:
        return singles
    elem = first.element_size()
    deltas = {b.data_ptr() - a.data_ptr() for a, b in zip(layers, layers[1:], strict=False)}
    storage = first.untyped_storage().data_ptr()
    same_storage = all(t.untyped_storage().data_ptr() == storage for t in layers)
    same_strides = all(t.stride() == first.stride() for t in layers)
    if len(deltas) != 1 or not (same_storage and same_strides):
        return singles
    delta = deltas.pop()
    if delta <= 0 or delta % elem:
        return singles
    stacked = first.as_strided(
        (len(layers), *first.shape), (delta // elem, *first.stride()), first.storage_offset()
    )
    return [LayerGroup(0, stacked)]


def widen_pair(
    src: torch.Tensor, rows: torch.Tensor, src_block_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reinterpret a layer view and its rows as the widest integer type (up to
    8 bytes) that both allow; the bytes copied stay bit-identical.

    ``src`` is a layer (group) view whose block dim is ``src_block_dim``;
    ``rows`` has the same dtype and the same innermost dim as ``src`` (true
    unless the block dim is the innermost dim, which is then left alone).
    Widening needs a unit-stride innermost dim whose byte length, every other
    byte stride and the byte storage offset divide by the new width. Any dtype
    (bf16, fp8, bool, ...) becomes a plain integer view, so copies never touch
    float arithmetic. Returns the inputs unchanged if no integer view exists.
    """
    a, b = src, rows
    elem = a.element_size()
    widths = (8, 4, 2, 1) if src_block_dim != a.dim() - 1 else (elem,)
    for width in widths:
        if width < elem or not (_can_view(a, width) and _can_view(b, width)):
            continue
        return a.view(INT_BY_SIZE[width]), b.view(INT_BY_SIZE[width])
    return a, b


def _can_view(t: torch.Tensor, width: int) -> bool:
    elem = t.element_size()
    if width == elem:
        return width in INT_BY_SIZE
    if t.dim() == 0 or t.stride(-1) != 1 or (t.shape[-1] * elem) % width:
        return False
    strides_ok = all((s * elem) % width == 0 for s in t.stride()[:-1])
    return strides_ok and (t.storage_offset() * elem) % width == 0


def _row_contiguous(t: torch.Tensor) -> bool:
    if t.shape[0] == 0:
        return True
    row = t.select(0, 0)
    row_numel = row.numel()
    no_overlap = t.shape[0] == 1 or abs(t.stride(0)) >= row_numel
    return row.is_contiguous() and no_overlap


def _bad_rows(buf: torch.Tensor, why: str) -> torch.Tensor:
    raise ValueError(f"byte buffer of shape {tuple(buf.shape)}: {why}")


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for s in shape:
        total *= int(s)
    return total
