"""Public entry points: validate arguments, pick an implementation, copy.

``pack_*`` gathers paged KV blocks into contiguous rows (one row per block id,
ready to become one store object); ``unpack_*`` is the exact inverse and
writes only the listed blocks. All four functions work in place on caller-owned
tensors, keep no reference to them after returning, and return the tensor
they wrote (``out`` or the layer(s)).

Implementations (``impl``):

* ``"torch"``: :mod:`kvcentric.kernels.reference` (``index_select(out=)`` /
  ``index_copy_``), synchronous on CPU, stream-ordered on CUDA;
* ``"triton"``: :mod:`kvcentric.kernels.triton_gather`, for CUDA tensors, or CPU tensors
  when ``TRITON_INTERPRET=1`` (Triton's interpreter). If the kernel cannot
  address a layout (see :func:`choose_impl`) the torch path runs instead;
* ``"dma"``: :mod:`kvcentric.kernels.dma`, one ``copy_`` (``cudaMemcpyAsync``) per
  contiguous piece of a page: any devices;
* ``"auto"``: Triton when the layers are on CUDA or ``TRITON_INTERPRET=1`` and
  Triton is installed, torch otherwise.

:class:`PagedCopy` is :func:`pack_blocks` / :func:`unpack_blocks` validated once for a
layer shape, its block ids and a rows shape, then run per layer: a step moves the same
pages of every layer, and validating ids, rows and the implementation per layer cost
several times the copy of a small page on CPU.

These copy page by page. Between a CUDA layer and host objects, the connector uses
:mod:`kvcentric.kernels.staged` instead (gather in HBM, one 2-D DMA per layer): page by
page across PCIe is 5-30x slower there (``benchmarks/micro/gpu_path.py``).

CUDA work is enqueued on the current stream and not synchronised; with
pinned host rows the caller must synchronise before reading/reusing them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcentric.config import triton_interpret
from kvcentric.kernels.dma import dma_pack, dma_unpack
from kvcentric.kernels.reference import torch_pack, torch_unpack
from kvcentric.kernels.tensor_views import (
    LayerGroup,
    block_shape,
    check_block_dim,
    check_layers,
    check_out_device,
    group_layers,
    normalize_ids,
    rows_view,
    widen_pair,
)
from kvcentric.kernels.triton_gather import triton_pack, triton_unpack, unsupported_reason

IMPLS = ("auto", "torch", "triton", "dma")
BlockIds = torch.Tensor | Sequence[int]
Layers = Sequence[torch.Tensor] | torch.Tensor


@dataclass(frozen=True)
class ImplChoice:
    """The implementation that runs (``"torch"`` or ``"triton"``) and why."""

    name: str
    reason: str


def triton_interpret_enabled() -> bool:
    """Whether Triton's interpreter is switched on (``TRITON_INTERPRET``, read by the
    config layer). Triton reads it when the kernels are first imported, so set it before
    the first Triton launch in the process."""
    return triton_interpret()


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (checked without importing)."""
    return importlib.util.find_spec("triton") is not None


def choose_impl(
    impl: str, groups: Sequence[LayerGroup], rows: torch.Tensor, block_dim: int
) -> ImplChoice:
    """Resolve ``impl`` for validated ``groups``/``rows`` (see module docstring).

    ValueError for an unknown ``impl``, or for ``impl="triton"`` when Triton is
    not installed or the tensors are on CPU without ``TRITON_INTERPRET=1``.
    Layouts the kernel cannot address (more than four strided dims per block
    after merging, element sizes over 8 bytes, grids over CUDA limits,
    unpinned host rows with CUDA layers) run on torch, with the reason.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl in ("torch", "dma"):
        return ImplChoice(impl, "requested")
    device = groups[0].tensor.device
    interpret = triton_interpret_enabled()
    if impl == "auto" and device.type != "cuda" and not interpret:
        return ImplChoice("torch", f"layers on {device} and TRITON_INTERPRET is not set")
    if not triton_available():
        if impl == "triton":
            raise ValueError("impl='triton' but the triton package is not installed")
        return ImplChoice("torch", "triton is not installed")
    if impl == "triton" and device.type != "cuda" and not interpret:
        raise ValueError(f"impl='triton' needs CUDA tensors or TRITON_INTERPRET=1 (got {device})")
    reason = unsupported_reason(groups, rows, block_dim, interpret)
    if reason:
        return ImplChoice("torch", f"fallback: {reason}")
    return ImplChoice("triton", "interpreter" if interpret else "cuda")


def pack_blocks(
    kv_layer: torch.Tensor,
    block_ids: BlockIds,
    out: torch.Tensor,
    *,
    block_dim: int = 0,
    impl: str = "auto",
) -> torch.Tensor:
    """Copy block ``block_ids[i]`` of ``kv_layer`` into ``out[i]``; return ``out``.

    ``kv_layer``: any-rank tensor, blocks along ``block_dim``, e.g. NHD
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` (block_dim 0) or flash
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (block_dim 1); may be
    strided. ``block_ids``: 1-D int32/int64 tensor (CPU or the layer's device)
    or a sequence of ints, each in ``[0, num_blocks)``. ``out``: ``[n, *rest]``
    (``rest`` = layer shape without ``block_dim``) of the layer dtype, or a
    uint8 byte view with the same bytes per row (see ``as_rows``); each row
    must be contiguous; it may be foreign memory (shm mmap, pinned host with
    a CUDA layer). Bit-exact equal to
    ``kv_layer.index_select(block_dim, block_ids).movedim(block_dim, 0)``.
    """
    return _pack([kv_layer], block_ids, out, block_dim, impl, single=True)


def unpack_blocks(
    packed: torch.Tensor,
    block_ids: BlockIds,
    kv_layer: torch.Tensor,
    *,
    block_dim: int = 0,
    impl: str = "auto",
) -> torch.Tensor:
    """Inverse of :func:`pack_blocks`: copy ``packed[i]`` into block ``block_ids[i]``
    of ``kv_layer`` (in place) and return ``kv_layer``; other blocks are untouched.

    Shapes and accepted forms as in :func:`pack_blocks` (``packed`` plays the
    role of ``out``). Ids should be unique: with duplicates it is unspecified
    which row lands in the block.
    """
    _unpack(packed, block_ids, [kv_layer], block_dim, impl, single=True)
    return kv_layer


def pack_blocks_layers(
    layers: Layers,
    block_ids: BlockIds,
    out: torch.Tensor,
    *,
    block_dim: int = 0,
    impl: str = "auto",
) -> torch.Tensor:
    """Multi-layer :func:`pack_blocks`: ``out[i, l]`` = block ``block_ids[i]`` of
    ``layers[l]``; return ``out``.

    ``layers``: sequence of per-layer tensors with equal shape, dtype and
    device (or one tensor whose dim 0 indexes layers). ``out``:
    ``[n, num_layers, *rest]`` of the layer dtype or a uint8 byte view of the
    same bytes per row, rows contiguous. Layers carved from one allocation at
    a uniform distance are copied by one kernel launch / one ``index_select``.
    """
    return _pack(_as_list(layers), block_ids, out, block_dim, impl, single=False)


def unpack_blocks_layers(
    packed: torch.Tensor,
    block_ids: BlockIds,
    layers: Layers,
    *,
    block_dim: int = 0,
    impl: str = "auto",
) -> Sequence[torch.Tensor] | torch.Tensor:
    """Inverse of :func:`pack_blocks_layers`: block ``block_ids[i]`` of
    ``layers[l]`` = ``packed[i, l]`` (in place); returns ``layers``."""
    _unpack(packed, block_ids, _as_list(layers), block_dim, impl, single=False)
    return layers


def _as_list(layers: Layers) -> list[torch.Tensor]:
    if isinstance(layers, torch.Tensor):
        if layers.dim() < 2:
            raise ValueError(f"a stacked layers tensor needs dims [L, ...], got {layers.dim()}-D")
        return list(layers.unbind(0))
    return list(layers)


def _prepare(
    packed: torch.Tensor,
    block_ids: BlockIds,
    layers: list[torch.Tensor],
    block_dim: int,
    single: bool,
    what: str,
) -> tuple[list[LayerGroup], torch.Tensor, torch.Tensor, int]:
    """Validate everything; return groups, ids (on the host when they came from it),
    rows ``[n, L, *rest]``, block dim."""
    check_layers(layers, "kv_layer" if single else "layers")
    first = layers[0]
    dim = check_block_dim(first.shape, block_dim)
    ids = normalize_ids(block_ids, first.shape[dim], first.device, move=False)
    rest = block_shape(first.shape, dim)
    row_shape = rest if single else (len(layers), *rest)
    rows = rows_view(packed, ids.numel(), row_shape, first.dtype, what)
    check_out_device(rows, first.device, what)
    return group_layers(layers), ids, rows.unsqueeze(1) if single else rows, dim


def _copy(choice: ImplChoice, groups: list[LayerGroup], ids: torch.Tensor,
          rows: torch.Tensor, dim: int, pack: bool) -> None:
    """Run the chosen implementation; ids go to the layers' device only for kernels
    that index on it (the DMA path wants host ints)."""
    if choice.name == "dma":
        host = ids.tolist()  # a device sync only if the caller passed device ids
        (dma_pack(groups, host, rows, dim) if pack else dma_unpack(rows, host, groups, dim))
        return
    ids = ids.to(groups[0].tensor.device, non_blocking=True)
    with torch.no_grad():
        if choice.name == "triton" and pack:
            triton_pack(groups, ids, rows, dim, triton_interpret_enabled())
        elif choice.name == "triton":
            triton_unpack(rows, ids, groups, dim, triton_interpret_enabled())
        elif pack:
            torch_pack(groups, ids, rows, dim)
        else:
            torch_unpack(rows, ids, groups, dim)


def _pack(
    layers: list[torch.Tensor],
    block_ids: BlockIds,
    out: torch.Tensor,
    block_dim: int,
    impl: str,
    single: bool,
) -> torch.Tensor:
    groups, ids, rows, dim = _prepare(out, block_ids, layers, block_dim, single, "out")
    _copy(choose_impl(impl, groups, rows, dim), groups, ids, rows, dim, pack=True)
    return out


def _unpack(
    packed: torch.Tensor,
    block_ids: BlockIds,
    layers: list[torch.Tensor],
    block_dim: int,
    impl: str,
    single: bool,
) -> None:
    groups, ids, rows, dim = _prepare(packed, block_ids, layers, block_dim, single, "packed")
    _copy(choose_impl(impl, groups, rows, dim), groups, ids, rows, dim, pack=False)


TensorSig = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


def tensor_sig(t: torch.Tensor) -> TensorSig:
    """What a :class:`PagedCopy` requires of every tensor it copies for: the template's
    shape, strides, dtype and device."""
    return tuple(t.shape), t.stride(), t.dtype, t.device


class PagedCopy:
    """:func:`pack_blocks` / :func:`unpack_blocks` of ``block_ids`` between layers shaped
    like ``kv_layer`` and rows shaped like ``rows``, validated here once (ids in range,
    rows' shape, contiguity and device, the implementation, as those functions do).

    :meth:`pack` and :meth:`unpack` then take any layer and rows with exactly the
    template's shape, strides, dtype and device (``ValueError`` otherwise, nothing
    copied), so the ids need no new check: every layer they index has the template's
    blocks. Keeps the ids (on the layers' device where the copy indexes there), never a
    reference to a layer or rows after a call returns."""

    def __init__(self, kv_layer: torch.Tensor, block_ids: BlockIds, rows: torch.Tensor, *,
                 block_dim: int = 0, impl: str = "auto") -> None:
        groups, ids, typed, dim = _prepare(rows, block_ids, [kv_layer], block_dim, True,
                                           "rows")
        self.choice = choose_impl(impl, groups, typed, dim)
        self.block_dim = dim
        self._ids = ids if self.choice.name == "dma" else \
            ids.to(kv_layer.device, non_blocking=True)
        self._layer = tensor_sig(kv_layer)
        self._rows = tensor_sig(rows)
        self._typed = tuple(typed.shape)  # [n, 1, *block]: the rows as the copy reads them
        self._dtype = kv_layer.dtype
        # torch's copy between a layer and rows on one device, as torch_pack/torch_unpack
        # run it, with the integer width widen_pair picks for these strides taken here:
        # it holds for every call whose two addresses are aligned to it (else the general
        # path runs); an int64 index, made once
        self._int: torch.dtype | None = None
        if self.choice.name == "torch" and typed.device == kv_layer.device and \
                not kv_layer.requires_grad:
            wide, _ = widen_pair(kv_layer.unsqueeze(0), typed.movedim(0, 1 + dim), 1 + dim)
            self._int = wide.dtype
            self._width = wide.element_size()
            self._index = self._ids.long()

    def _check(self, kv_layer: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` as the copy reads them, once both match the template."""
        if tensor_sig(kv_layer) != self._layer:
            raise ValueError(f"kv_layer {tensor_sig(kv_layer)} is not shaped like this "
                             f"copy's {self._layer}")
        if tensor_sig(rows) != self._rows:
            raise ValueError(f"rows {tensor_sig(rows)} are not shaped like this copy's "
                             f"{self._rows}")
        try:
            return rows.view(self._dtype).view(self._typed) if rows.dtype != self._dtype \
                else rows.view(self._typed)
        except RuntimeError as exc:  # the base address is not aligned for the dtype
            raise ValueError(f"rows are not aligned for {self._dtype}: {exc}") from exc

    def _direct(self, kv_layer: torch.Tensor, typed: torch.Tensor, pack: bool) -> bool:
        """The torch copy with the width chosen at construction; False where it does not
        apply (another implementation, or an address not aligned to that width)."""
        if self._int is None:
            return False
        w, dim = self._width, 1 + self.block_dim
        layer, rows = kv_layer.unsqueeze(0), typed.movedim(0, dim)
        if layer.data_ptr() % w or rows.data_ptr() % w:
            return False
        layer, rows = layer.view(self._int), rows.view(self._int)
        if pack:
            torch.index_select(layer, dim, self._index, out=rows)
        else:
            layer.index_copy_(dim, self._index, rows)
        return True

    def pack(self, kv_layer: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy the blocks of ``kv_layer`` into ``rows`` (in place)."""
        typed = self._check(kv_layer, rows)
        if not self._direct(kv_layer, typed, pack=True):
            _copy(self.choice, [LayerGroup(0, kv_layer.unsqueeze(0))], self._ids, typed,
                  self.block_dim, pack=True)

    def unpack(self, rows: torch.Tensor, kv_layer: torch.Tensor) -> None:
        """Copy ``rows`` into the blocks of ``kv_layer`` (in place; others untouched)."""
        typed = self._check(kv_layer, rows)
        if not self._direct(kv_layer, typed, pack=False):
            _copy(self.choice, [LayerGroup(0, kv_layer.unsqueeze(0))], self._ids, typed,
                  self.block_dim, pack=False)


def explain_impl(
    layers: Layers,
    block_ids: BlockIds,
    out: torch.Tensor,
    *,
    block_dim: int = 0,
    impl: str = "auto",
) -> ImplChoice:
    """Which implementation a pack/unpack with these arguments would run, and why.

    ``layers`` is one KV layer tensor (the :func:`pack_blocks` form, ``out``
    ``[n, *rest]``) or a sequence of layers (the ``*_layers`` form). Validates
    like the copy functions but copies nothing.
    """
    single = isinstance(layers, torch.Tensor)
    as_list = [layers] if isinstance(layers, torch.Tensor) else list(layers)
    groups, _, rows, dim = _prepare(out, block_ids, as_list, block_dim, single, "out")
    return choose_impl(impl, groups, rows, dim)
