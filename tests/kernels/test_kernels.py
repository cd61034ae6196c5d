"""Tests for ``kernels``: block pack/unpack between paged KV layers and rows.

Every data test runs for each implementation in ``IMPLS_UNDER_TEST``: the
torch and per-page DMA paths in a normal run; the Triton kernels when ``TRITON_INTERPRET=1`` is
set (``tests/kernels/test_kernels_triton.py`` re-runs this file that way in a
subprocess, because Triton reads the switch when it is imported). GPU tests
live in ``tests/kernels/test_kernels_gpu.py``.

Sizes are tiny: the Triton interpreter costs ~64 ms per MiB.
"""

from __future__ import annotations

import mmap

import pytest
import torch

from kvcentric import kernels
from kvcentric.kernels import (
    PagedCopy,
    as_rows,
    explain_impl,
    pack_blocks,
    pack_blocks_layers,
    pack_reference,
    triton_gather,
    unpack_blocks,
    unpack_blocks_layers,
    unpack_reference,
)
from kvcentric.kernels.tensor_views import group_layers

INTERPRET = kernels.triton_interpret_enabled()
IMPLS_UNDER_TEST = ["triton"] if INTERPRET else ["torch", "dma"]
NB, BS, H, D = 7, 4, 2, 8  # blocks, block size, kv heads, head dim
INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

LAYOUTS = {  # name -> (shape for nb blocks, block_dim)
    "cpu_vllm": (lambda nb: (nb, H, BS, 2 * D), 0),
    "flash": (lambda nb: (2, nb, BS, H, D), 1),
    "nhd": (lambda nb: (nb, BS, H, D), 0),
    "hnd": (lambda nb: (nb, H, BS, D), 0),
    "mla": (lambda nb: (nb, BS, D), 0),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8]
DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
ID_SETS = {"ragged": [5, 0, 3], "single": [4], "all": [3, 6, 0, 2, 5, 1, 4]}


def filled(shape: tuple[int, ...], dtype: torch.dtype, start: int = 0) -> torch.Tensor:
    """Bit patterns ``start, start+1, ...`` (wrapping at the dtype width) as ``dtype``;
    distinct for every element of 2- and 4-byte dtypes at these sizes."""
    width = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    vals = torch.arange(start, start + numel, dtype=torch.int64)
    vals = (vals + 2 ** (8 * width - 1)) % 2 ** (8 * width) - 2 ** (8 * width - 1)
    return vals.to(INT_OF[width]).view(dtype).view(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bit-exact comparison (NaN patterns compare equal)."""
    return t.view(INT_OF[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def make_layer(layout: str, dtype: torch.dtype, variant: str, start: int = 0, device="cpu"):
    """A KV layer of ``layout``: contiguous, a slice of a bigger tensor, or
    with a padded innermost stride. Returns (layer, block_dim)."""
    shape_fn, bd = LAYOUTS[layout]
    shape = shape_fn(NB)
    if variant == "contig":
        return filled(shape, dtype, start).to(device), bd
    if variant == "slice":
        big = list(shape_fn(NB + 3))
        big[-2] += 1
        layer = filled(tuple(big), dtype, start).to(device)
        return layer.narrow(bd, 2, NB).narrow(-2, 1, shape[-2]), bd
    assert variant == "padded"
    layer = filled((*shape[:-1], shape[-1] + 3), dtype, start).to(device)
    return layer[..., : shape[-1]], bd


def ids_tensor(name: str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(ID_SETS[name], dtype=dtype)


def rest_shape(layer: torch.Tensor, bd: int) -> tuple[int, ...]:
    return tuple(layer.shape[:bd]) + tuple(layer.shape[bd + 1 :])


def expect_impl(impl: str, layer, ids, out, bd: int) -> None:
    """The requested path really runs (no silent fallback for supported layouts)."""
    assert explain_impl(layer, ids, out, block_dim=bd, impl=impl).name == impl


@pytest.fixture(params=IMPLS_UNDER_TEST)
def impl(request: pytest.FixtureRequest) -> str:
    return request.param


# ---------------------------------------------------------------- single layer


@pytest.mark.parametrize("variant", ["contig", "slice", "padded"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pack_matches_reference(impl: str, layout: str, variant: str) -> None:
    layer, bd = make_layer(layout, torch.float16, variant)
    ids = ids_tensor("ragged")
    out = torch.full((3, *rest_shape(layer, bd)), -1.0, dtype=torch.float16)
    expect_impl(impl, layer, ids, out, bd)
    assert pack_blocks(layer, ids, out, block_dim=bd, impl=impl) is out
    assert same(out, pack_reference(layer, ids, bd))


@pytest.mark.parametrize("variant", ["contig", "slice", "padded"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_round_trip(impl: str, layout: str, variant: str) -> None:
    layer, bd = make_layer(layout, torch.float16, variant)
    original = layer.clone()
    ids = ids_tensor("ragged")
    packed = torch.empty((3, *rest_shape(layer, bd)), dtype=torch.float16)
    pack_blocks(layer, ids, packed, block_dim=bd, impl=impl)
    layer.index_fill_(bd, ids, 0)
    assert unpack_blocks(packed, ids, layer, block_dim=bd, impl=impl) is layer
    assert same(layer, original)


@pytest.mark.parametrize("layout", ["nhd", "flash"])
def test_unpack_writes_only_listed_blocks(impl: str, layout: str) -> None:
    layer, bd = make_layer(layout, torch.float32, "slice")
    ids = ids_tensor("ragged")
    packed = filled((3, *rest_shape(layer, bd)), torch.float32, start=100_000)
    expected = unpack_reference(packed, ids, layer, bd)
    unpack_blocks(packed, ids, layer, block_dim=bd, impl=impl)
    assert same(layer, expected)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_and_id_types(impl: str, dtype: torch.dtype, id_dtype: torch.dtype) -> None:
    layer, bd = make_layer("flash", dtype, "padded")
    ids = ids_tensor("ragged", id_dtype)
    out = torch.empty((3, *rest_shape(layer, bd)), dtype=dtype)
    expect_impl(impl, layer, ids, out, bd)
    pack_blocks(layer, ids, out, block_dim=bd, impl=impl)
    assert same(out, pack_reference(layer, ids, bd))
    fresh = torch.zeros_like(layer)
    unpack_blocks(out, ids, fresh, block_dim=bd, impl=impl)
    assert same(fresh, unpack_reference(out, ids, torch.zeros_like(layer), bd))


@pytest.mark.parametrize("id_set", list(ID_SETS))
def test_id_sets(impl: str, id_set: str) -> None:
    layer, bd = make_layer("nhd", torch.bfloat16, "contig")
    ids = ids_tensor(id_set, torch.int32)
    out = torch.empty((len(ids), *rest_shape(layer, bd)), dtype=torch.bfloat16)
    pack_blocks(layer, ids, out, block_dim=bd, impl=impl)
    assert same(out, pack_reference(layer, ids, bd))
    target = torch.zeros_like(layer)
    unpack_blocks(out, ids.tolist(), target, block_dim=bd, impl=impl)
    assert same(target, unpack_reference(out, ids, torch.zeros_like(layer), bd))


def test_strided_ids(impl: str) -> None:
    layer, bd = make_layer("mla", torch.float32, "contig")
    ids = torch.tensor([6, -1, 1, -1, 4], dtype=torch.int32)[::2]
    out = torch.empty((3, BS, D))
    pack_blocks(layer, ids, out, impl=impl)
    assert same(out, pack_reference(layer, ids, bd))


def test_empty_ids_is_a_no_op(impl: str) -> None:
    layer, bd = make_layer("nhd", torch.float32, "contig")
    out = torch.empty((0, *rest_shape(layer, bd)))
    pack_blocks(layer, [], out, impl=impl)
    before = layer.clone()
    unpack_blocks(out, torch.empty(0, dtype=torch.int32), layer, impl=impl)
    assert same(layer, before)


def test_many_strided_dims_fall_back_to_torch(impl: str) -> None:
    # Five dims that cannot merge: more than the kernel addresses.
    base = filled((NB, 2, 2, 2, 2, 3), torch.float32)
    layer = base.permute(0, 5, 4, 3, 2, 1)
    ids = ids_tensor("ragged")
    out = torch.empty((3, *layer.shape[1:]))
    choice = explain_impl(layer, ids, out, impl=impl)
    assert choice.name == ("dma" if impl == "dma" else "torch")
    pack_blocks(layer, ids, out, impl=impl)
    assert same(out, pack_reference(layer, ids, 0))


@pytest.mark.parametrize("variant", ["contig", "padded"])
def test_many_tiles_per_block(impl: str, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tiles of 16 elements: several tiles per block, the last one partial.
    monkeypatch.setattr(triton_gather, "TILE_BYTES", 32)
    monkeypatch.setattr(triton_gather, "INTERPRET_TILE_BYTES", 32)
    layer = filled((NB, 3, 5, 10), torch.float16)[..., :7]
    layer = layer if variant == "padded" else layer.contiguous()
    ids = ids_tensor("all", torch.int32)
    out = torch.empty((NB, 3, 5, 7), dtype=torch.float16)
    pack_blocks(layer, ids, out, impl=impl)
    assert same(out, pack_reference(layer, ids, 0))
    target = torch.zeros_like(layer)
    unpack_blocks(out, ids, target, impl=impl)
    assert same(target, layer)


def test_tiling_limits() -> None:
    tiling = triton_gather._tiling
    assert tiling(1, 100, 8, interpret=False) == (1, 128, 1, 1)
    assert tiling(15, 7, 2, interpret=False) == (16, 8, 1, 1)
    big = tiling(3, 10**9, 1, interpret=False)
    assert big is not None
    rows, cols, col_tiles, tiles = big
    assert tiles <= triton_gather.MAX_TILES and cols * col_tiles >= 10**9
    assert tiling(1, 2**40, 1, interpret=False) is None


# ---------------------------------------------------------------- byte views


def test_uint8_out_from_mmap(impl: str) -> None:
    layer, bd = make_layer("flash", torch.bfloat16, "contig")
    ids = ids_tensor("ragged", torch.int32)
    rest = rest_shape(layer, bd)
    row_bytes = layer[:, 0].numel() * 2
    shm = mmap.mmap(-1, 3 * row_bytes)
    buf = torch.frombuffer(shm, dtype=torch.uint8)
    pack_blocks(layer, ids, buf.view(3, row_bytes), block_dim=bd, impl=impl)
    assert same(as_rows(buf, 3, rest, torch.bfloat16), pack_reference(layer, ids, bd))
    target = torch.zeros_like(layer)
    unpack_blocks(buf.view(3, row_bytes), ids, target, block_dim=bd, impl=impl)
    assert same(target.index_select(bd, ids), layer.index_select(bd, ids))
    del buf
    shm.close()


def test_uint8_out_slab_rows(impl: str) -> None:
    # Objects inside a slab: rows contiguous, row stride larger than a row.
    layer, bd = make_layer("hnd", torch.float16, "padded")
    ids = ids_tensor("all")
    row_bytes = layer[0].numel() * 2
    slab = torch.zeros(NB, row_bytes + 64, dtype=torch.uint8)
    out = slab[:, 16 : 16 + row_bytes]
    pack_blocks(layer, ids, out, impl=impl)
    typed = as_rows(out, NB, rest_shape(layer, bd), torch.float16)
    assert same(typed, pack_reference(layer, ids, bd))
    assert not slab[:, :16].any() and not slab[:, 16 + row_bytes :].any()


def test_as_rows_views_without_copy() -> None:
    buf = torch.arange(2 * 12, dtype=torch.uint8)
    rows = as_rows(buf, 2, (3, 2), torch.float16)
    assert rows.shape == (2, 3, 2) and rows.data_ptr() == buf.data_ptr()
    assert as_rows(buf.view(2, 12), 2, (3, 2), torch.float16).data_ptr() == buf.data_ptr()
    with pytest.raises(ValueError, match="bytes"):
        as_rows(buf, 3, (3, 2), torch.float16)
    with pytest.raises(ValueError, match="aligned"):
        as_rows(torch.zeros(2, 25, dtype=torch.uint8)[:, 1:], 2, (3, 2), torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        as_rows(buf.view(torch.int8), 2, (3, 2), torch.float16)


# ---------------------------------------------------------------- multi-layer

NUM_LAYERS = 3


def make_layers(kind: str, layout: str, dtype: torch.dtype, device="cpu"):
    """Layers as separate tensors, one allocation split per layer, or interleaved
    (``big[:, l]`` of a ``[num_blocks, num_layers, ...]`` allocation)."""
    shape_fn, bd = LAYOUTS[layout]
    shape = shape_fn(NB)
    if kind == "separate":
        layers = [make_layer(layout, dtype, "padded", k * 5000, device)[0] for k in range(3)]
        return layers, bd
    if kind == "stacked":
        return list(filled((NUM_LAYERS, *shape), dtype).to(device).unbind(0)), bd
    big = filled((*shape[: bd + 1], NUM_LAYERS, *shape[bd + 1 :]), dtype).to(device)
    return list(big.unbind(bd + 1)), bd


def layers_reference(layers, ids, bd: int) -> torch.Tensor:
    return torch.stack([pack_reference(t, ids, bd) for t in layers], dim=1)


@pytest.mark.parametrize("layout", ["nhd", "flash", "mla"])
@pytest.mark.parametrize("kind", ["separate", "stacked", "interleaved"])
def test_multi_layer_round_trip(impl: str, kind: str, layout: str) -> None:
    layers, bd = make_layers(kind, layout, torch.float16)
    originals = [t.clone() for t in layers]
    ids = ids_tensor("ragged")
    out = torch.empty((3, NUM_LAYERS, *rest_shape(layers[0], bd)), dtype=torch.float16)
    expect_impl(impl, layers, ids, out, bd)
    pack_blocks_layers(layers, ids, out, block_dim=bd, impl=impl)
    assert same(out, layers_reference(layers, ids, bd))
    for t in layers:
        t.index_fill_(bd, ids, 0)
    unpack_blocks_layers(out, ids, layers, block_dim=bd, impl=impl)
    assert all(same(t, o) for t, o in zip(layers, originals, strict=True))


@pytest.mark.parametrize(("kind", "groups"), [("separate", 3), ("stacked", 1), ("interleaved", 1)])
def test_layers_from_one_allocation_form_one_group(kind: str, groups: int) -> None:
    layers, _ = make_layers(kind, "flash", torch.float16)
    grouped = group_layers(layers)
    assert len(grouped) == groups
    for group in grouped:
        for k, view in enumerate(group.tensor.unbind(0)):
            assert view.data_ptr() == layers[group.first + k].data_ptr()
            assert view.stride() == layers[group.first + k].stride()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=str)
def test_multi_layer_uint8_rows(impl: str, dtype: torch.dtype) -> None:
    layers, bd = make_layers("separate", "cpu_vllm", dtype)
    ids = ids_tensor("all", torch.int32)
    row_bytes = NUM_LAYERS * layers[0][0].numel() * layers[0].element_size()
    out = torch.empty(NB, row_bytes, dtype=torch.uint8)
    pack_blocks_layers(layers, ids, out, impl=impl)
    typed = as_rows(out, NB, (NUM_LAYERS, *layers[0].shape[1:]), dtype)
    assert same(typed, layers_reference(layers, ids, bd))
    targets = [torch.zeros_like(t) for t in layers]
    unpack_blocks_layers(out, ids, targets, impl=impl)
    assert all(same(t, o) for t, o in zip(targets, layers, strict=True))


def test_multi_layer_accepts_stacked_tensor(impl: str) -> None:
    stacked = filled((NUM_LAYERS, NB, BS, D), torch.float32)
    ids = ids_tensor("single")
    out = torch.empty((1, NUM_LAYERS, BS, D))
    pack_blocks_layers(stacked, ids, out, impl=impl)
    assert same(out, layers_reference(list(stacked), ids, 0))


# ---------------------------------------------------------------- bad input


def _bad_cases():
    layer = torch.zeros(NB, BS, D, dtype=torch.float16)
    out = torch.zeros(2, BS, D, dtype=torch.float16)
    meta = torch.empty(2, BS, D, dtype=torch.float16, device="meta")
    return {
        "out of range": (lambda: pack_blocks(layer, [0, NB], out), "blocks"),
        "negative": (lambda: pack_blocks(layer, [-1, 0], out), "negative"),
        "2-D ids": (lambda: pack_blocks(layer, torch.zeros(1, 2, dtype=torch.int64), out), "1-D"),
        "float ids": (lambda: pack_blocks(layer, torch.zeros(2), out), "int32 or int64"),
        "float list": (lambda: pack_blocks(layer, [0.0, 1.5], out), "int32 or int64"),
        "1-D stack": (lambda: pack_blocks_layers(torch.zeros(4), [0], out[:1]), "stacked"),
        "dtype": (lambda: pack_blocks(layer, [0, 1], out.float()), "dtype"),
        "shape": (lambda: pack_blocks(layer, [0, 1], out[:, :2]), "shape"),
        "row count": (lambda: pack_blocks(layer, [0, 1, 2], out), "shape"),
        "bytes": (lambda: pack_blocks(layer, [0, 1], torch.zeros(2, 7, dtype=torch.uint8)), "byte"),
        "rows": (lambda: pack_blocks(layer, [0, 1], out.transpose(1, 2).contiguous().mT), "row"),
        "out device": (lambda: pack_blocks(layer, [0, 1], meta), "meta"),
        "ids device": (
            lambda: pack_blocks(layer, torch.zeros(2, device="meta").long(), out),
            "meta",
        ),
        "block_dim": (lambda: pack_blocks(layer, [0], out[:1], block_dim=3), "block_dim"),
        "impl": (lambda: pack_blocks(layer, [0, 1], out, impl="cuda"), "impl"),
        "packed dtype": (lambda: unpack_blocks(out.float(), [0, 1], layer), "dtype"),
        "layer shapes": (
            lambda: pack_blocks_layers([layer, layer[:, :2]], [0], out[:1]),
            "shape",
        ),
        "layer dtypes": (lambda: pack_blocks_layers([layer, layer.float()], [0], out[:1]), "dtype"),
        "no layers": (lambda: pack_blocks_layers([], [0], out[:1]), "non-empty"),
        "layer devices": (
            lambda: pack_blocks_layers([layer, layer.to("meta")], [0], out[:1]),
            "meta",
        ),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_raises_value_error(case: str) -> None:
    call, match = _bad_cases()[case]
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.skipif(INTERPRET, reason="this test process runs Triton's interpreter "
                    "(TRITON_INTERPRET=1), where Triton is valid on CPU")
def test_triton_on_cpu_without_interpreter_is_rejected() -> None:
    layer = torch.zeros(NB, BS, D)
    with pytest.raises(ValueError, match="triton"):
        pack_blocks(layer, [0], torch.zeros(1, BS, D), impl="triton")
    assert explain_impl(layer, [0], torch.zeros(1, BS, D)).name == "torch"


def test_staged_copies_need_a_cuda_layer() -> None:
    from kvcentric.kernels.staged import staged_pack, staged_unpack

    layer, bd = make_layer("nhd", torch.float32, "contig")
    page_bytes = layer[0].numel() * layer.element_size()
    host = torch.zeros((1, 2 * page_bytes), dtype=torch.uint8)
    with pytest.raises(ValueError, match="CUDA layer"):
        staged_pack(layer, torch.tensor([0, 1]), host, block_dim=bd)
    with pytest.raises(ValueError, match="CUDA layer"):
        staged_unpack(host, torch.tensor([0, 1]), layer, block_dim=bd)
    with pytest.raises(ValueError, match="uint8 CPU tensor"):
        staged_pack(layer, torch.tensor([0, 1]), host.float(), block_dim=bd)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_paged_copy_validated_once_moves_every_layer_as_pack_blocks_does(
        impl: str, layout: str) -> None:
    """The connector's case: the same block ids of every layer to and from rows at other
    places of one slab (object after object), validated on the first layer only."""
    layers = [make_layer(layout, torch.bfloat16, "slice", start=1000 * i)[0] for i in range(3)]
    bd = LAYOUTS[layout][1]
    ids = ids_tensor("ragged")
    row_bytes = layers[0].select(bd, 0).numel() * 2
    slab = torch.zeros(len(layers), 3, row_bytes + 64, dtype=torch.uint8)
    copy = PagedCopy(layers[0], ids, slab[0, :, 32:32 + row_bytes], block_dim=bd, impl=impl)
    assert copy.choice == explain_impl(layers[0], ids, slab[0, :, 32:32 + row_bytes],
                                       block_dim=bd, impl=impl)
    for i, layer in enumerate(layers):
        copy.pack(layer, slab[i, :, 32:32 + row_bytes])
        want = torch.zeros(3, row_bytes, dtype=torch.uint8)
        pack_blocks(layer, ids, want, block_dim=bd, impl=impl)
        assert torch.equal(slab[i, :, 32:32 + row_bytes], want)
    assert not slab[..., :32].any() and not slab[..., 32 + row_bytes:].any()
    # rows aligned for bf16 but not for the integer width picked at 32 bytes in: the same
    # bytes, by the general path
    odd = torch.zeros(3, row_bytes + 64, dtype=torch.uint8)
    copy.pack(layers[1], odd[:, 34:34 + row_bytes])
    assert torch.equal(odd[:, 34:34 + row_bytes], slab[1, :, 32:32 + row_bytes])
    for i, layer in enumerate(layers):
        target = make_layer(layout, torch.bfloat16, "slice")[0].zero_()  # same strides
        copy.unpack(slab[i, :, 32:32 + row_bytes], target)
        assert same(target.index_select(bd, ids), layer.index_select(bd, ids))
        others = [b for b in range(NB) if b not in ID_SETS["ragged"]]
        assert not bits(target.index_select(bd, torch.tensor(others))).any()


def test_a_paged_copy_refuses_what_it_did_not_validate() -> None:
    """Ids out of range are refused when it is made; a layer or rows of another shape,
    stride, dtype or alignment at a call, before a byte is copied."""
    layer, bd = make_layer("nhd", torch.float16, "contig")
    ids = ids_tensor("ragged")
    row_bytes = layer[0].numel() * 2
    rows = torch.zeros(3, row_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="id"):
        PagedCopy(layer, torch.tensor([0, NB]), rows)
    copy = PagedCopy(layer, ids, rows)
    smaller = layer[: NB - 1]  # fewer blocks: the checked ids could run past its end
    bad_layers = [smaller, layer.to(torch.bfloat16), make_layer("nhd", torch.float16,
                                                                 "padded")[0]]
    for bad in bad_layers:
        with pytest.raises(ValueError, match="not shaped like"):
            copy.pack(bad, rows)
        with pytest.raises(ValueError, match="not shaped like"):
            copy.unpack(rows, bad)
    slab = torch.zeros(3 * row_bytes + 1, dtype=torch.uint8)
    for bad_rows in (rows[:2], torch.zeros(3, row_bytes + 2, dtype=torch.uint8)[:, 1:-1],
                     slab[1:].view(3, row_bytes)):
        with pytest.raises(ValueError):
            copy.pack(layer, bad_rows)
    assert not rows.any() and not slab.any()
