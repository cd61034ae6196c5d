"""GPU tests for ``kernels``: torch and Triton paths on CUDA tensors, and rows
in pinned / pageable host memory. Marked ``gpu``; skipped without CUDA.

Helpers (layouts, bit-exact comparison) come from ``tests/kernels/test_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch

from kvcentric import kernels
from kvcentric.kernels import (
    as_rows,
    explain_impl,
    pack_blocks,
    pack_blocks_layers,
    pack_reference,
    strided_dma,
    unpack_blocks,
    unpack_blocks_layers,
)
from kvcentric.kernels.staged import (
    staged_pack,
    staged_pack_layers,
    staged_unpack,
    staged_unpack_layers,
)
from tests.kernels.test_kernels import (
    DTYPES,
    LAYOUTS,
    NB,
    NUM_LAYERS,
    expect_impl,
    ids_tensor,
    layers_reference,
    make_layer,
    make_layers,
    rest_shape,
    same,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("gpu_impl", ["torch", "triton"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpu_round_trip(gpu_impl: str, layout: str) -> None:
    if gpu_impl == "triton" and not kernels.triton_available():
        pytest.skip("triton is not installed")
    layer, bd = make_layer(layout, torch.bfloat16, "slice", device="cuda")
    original = layer.clone()
    ids = ids_tensor("ragged", torch.int32).cuda()
    out = torch.empty((3, *rest_shape(layer, bd)), dtype=layer.dtype, device="cuda")
    expect_impl(gpu_impl, layer, ids, out, bd)
    pack_blocks(layer, ids, out, block_dim=bd, impl=gpu_impl)
    assert same(out, pack_reference(layer, ids, bd))
    layer.index_fill_(bd, ids.long(), 0)
    unpack_blocks(out, ids, layer, block_dim=bd, impl=gpu_impl)
    assert same(layer, original)


@pytest.mark.parametrize("pinned", [True, False])
def test_gpu_to_host_rows(pinned: bool) -> None:
    layers, bd = make_layers("stacked", "flash", torch.float16, device="cuda")
    ids = ids_tensor("all").cuda()
    row_bytes = NUM_LAYERS * layers[0][:, 0].numel() * 2
    out = torch.zeros(NB, row_bytes, dtype=torch.uint8, pin_memory=pinned)
    choice = explain_impl(layers, ids, out, block_dim=bd)
    assert choice.name == ("triton" if pinned and kernels.triton_available() else "torch")
    pack_blocks_layers(layers, ids, out, block_dim=bd)
    torch.cuda.synchronize()
    typed = as_rows(out, NB, (NUM_LAYERS, *rest_shape(layers[0], bd)), torch.float16)
    assert same(typed, layers_reference(layers, ids, bd).cpu())
    targets = [torch.zeros_like(t) for t in layers]
    unpack_blocks_layers(out, ids, targets, block_dim=bd)
    assert all(same(t, o) for t, o in zip(targets, layers, strict=True))


@pytest.mark.parametrize("kind", ["separate", "stacked", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_multi_layer_dtypes(dtype: torch.dtype, kind: str) -> None:
    layers, bd = make_layers(kind, "nhd", dtype, device="cuda")
    ids = ids_tensor("ragged", torch.int32).cuda()
    out = torch.empty((3, NUM_LAYERS, *rest_shape(layers[0], bd)), dtype=dtype, device="cuda")
    pack_blocks_layers(layers, ids, out, block_dim=bd)
    assert same(out, layers_reference(layers, ids, bd))
    targets = [torch.zeros_like(t) for t in layers]
    unpack_blocks_layers(out, ids, targets, block_dim=bd)
    for target, layer in zip(targets, layers, strict=True):
        assert same(target.index_select(bd, ids), layer.index_select(bd, ids))


def object_rows(g: int, k: int, page_bytes: int, pinned: bool) -> torch.Tensor:
    """``[g, k * page_bytes]`` uint8 host rows strided like objects in an arena (each row
    followed by a gap of a row's size), filled with a marker byte."""
    buf = torch.full((g, 2 * k * page_bytes), 0xA5, dtype=torch.uint8, pin_memory=pinned)
    return buf[:, : k * page_bytes]


@pytest.mark.parametrize("dma2d", [True, False], ids=["dma2d", "per-row"])
@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("gpu_impl", ["auto", "torch", "triton"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_staged_round_trip_through_object_rows(layout: str, gpu_impl: str, pinned: bool,
                                               dma2d: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    if gpu_impl == "triton" and not kernels.triton_available():
        pytest.skip("triton is not installed")
    if dma2d and not strided_dma.available():
        pytest.skip("no CUDA driver library")
    monkeypatch.setattr(strided_dma, "available", lambda: dma2d)
    layer, bd = make_layer(layout, torch.bfloat16, "slice", device="cuda")
    original = layer.clone()
    page_bytes = layer.select(bd, 0).numel() * layer.element_size()
    ids = torch.tensor([4, 0, 6, 2, 5, 1], dtype=torch.int32)  # 3 objects of 2 pages
    host = object_rows(3, 2, page_bytes, pinned)
    staged_pack(layer, ids, host, block_dim=bd, impl=gpu_impl)
    torch.cuda.synchronize()
    want = pack_reference(layer, ids.cuda(), bd).contiguous().view(torch.uint8).cpu()
    assert torch.equal(host.reshape(6, page_bytes), want.reshape(6, page_bytes))
    assert torch.equal(host.as_strided((3, 2 * page_bytes), (host.stride(0), 1),
                                       2 * page_bytes), torch.full((3, 2 * page_bytes), 0xA5,
                                                                   dtype=torch.uint8))
    layer.index_fill_(bd, ids.long().cuda(), 0)
    staged_unpack(host, ids, layer, block_dim=bd, impl=gpu_impl)
    torch.cuda.synchronize()
    assert same(layer, original)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_staged_unpack_writes_only_the_named_positions(layout: str) -> None:
    layer, bd = make_layer(layout, torch.float16, "contig", device="cuda")
    page_bytes = layer.select(bd, 0).numel() * layer.element_size()
    host = object_rows(2, 3, page_bytes, pinned=True)
    staged_pack(layer, torch.tensor([0, 1, 2, 3, 4, 5]), host, block_dim=bd)
    target = torch.zeros_like(layer)
    # pages 1 and 4 are the engine's own (SKIP): only positions 0, 2, 3, 5 move
    staged_unpack(host, torch.tensor([6, 5, 1, 0]), target, block_dim=bd,
                  positions=torch.tensor([0, 2, 3, 5]))
    torch.cuda.synchronize()
    for block, src in ((6, 0), (5, 2), (1, 3), (0, 5)):
        assert same(target.select(bd, block), layer.select(bd, src))
    for block in (2, 3, 4):
        assert not target.select(bd, block).any()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_staged_layers_move_several_layers_per_transfer_bit_exact(layout: str) -> None:
    """``staged_*_layers``: object rows hold consecutive layers' spans back to back (as
    stored objects do); several layers pack and unpack as one DMA, bit-exact against the
    single-layer path, SKIP positions left alone."""
    layers = [make_layer(layout, torch.bfloat16, "slice", start=i * 1000, device="cuda")[0]
              for i in range(3)]
    bd = make_layer(layout, torch.bfloat16, "slice", device="cuda")[1]
    page_bytes = layers[0].select(bd, 0).numel() * layers[0].element_size()
    ids = torch.tensor([4, 0, 6, 2, 5, 1], dtype=torch.int64).cuda()  # 2 objects of 3 pages
    host = torch.zeros((2, 3 * 3 * page_bytes), dtype=torch.uint8, pin_memory=True)
    staged_pack_layers(layers, ids, host, block_dim=bd)
    torch.cuda.synchronize()
    one = torch.zeros((2, 3 * page_bytes), dtype=torch.uint8, pin_memory=True)
    for j, layer in enumerate(layers):  # layer j's span of every object = staged_pack's
        staged_pack(layer, ids, one, block_dim=bd)
        torch.cuda.synchronize()
        assert torch.equal(host.view(2, 3, -1)[:, j], one)
    targets = [torch.zeros_like(t) for t in layers]
    staged_unpack_layers(host, ids[[0, 2, 3, 5]], targets, block_dim=bd,
                         positions=torch.tensor([0, 2, 3, 5]))
    torch.cuda.synchronize()
    for layer, target in zip(layers, targets, strict=True):
        for block in (4, 6, 2, 1):
            assert same(target.select(bd, block), layer.select(bd, block))
        for block in (0, 5, 3):
            assert not target.select(bd, block).any()
    with pytest.raises(ValueError, match="layers' worth"):
        staged_pack_layers(layers[:2], ids, host[:, :7 * page_bytes], block_dim=bd)


def test_staged_bad_arguments_raise_value_error() -> None:
    layer, bd = make_layer("flash", torch.float16, "contig", device="cuda")
    page_bytes = layer.select(bd, 0).numel() * layer.element_size()
    host = object_rows(2, 2, page_bytes, pinned=True)
    with pytest.raises(ValueError, match="3 block ids for 4 pages"):
        staged_pack(layer, torch.tensor([0, 1, 2]), host, block_dim=bd)
    with pytest.raises(ValueError, match="whole"):
        staged_pack(layer, torch.tensor([0, 1]), host[:, :-2], block_dim=bd)
    with pytest.raises(ValueError, match="positions"):
        staged_unpack(host, torch.tensor([0, 1]), layer, block_dim=bd)


def test_staged_copies_from_a_fresh_thread() -> None:
    """A thread whose only CUDA work is cached allocations and a stream switch has no
    current context until the 2-D DMA binds the device's primary one (found by the
    worker's copy thread)."""
    import threading

    layer, bd = make_layer("flash", torch.float16, "contig", device="cuda")
    page_bytes = layer.select(bd, 0).numel() * layer.element_size()
    host = object_rows(2, 2, page_bytes, pinned=True)
    staged_pack(layer, torch.tensor([3, 1, 0, 2]), host, block_dim=bd)
    torch.cuda.synchronize()
    target, errors, lane = torch.zeros_like(layer), [], torch.cuda.Stream()

    def copy() -> None:
        try:
            with torch.cuda.stream(lane):
                staged_unpack(host, torch.tensor([3, 1, 0, 2]), target, block_dim=bd)
                torch.cuda.current_stream().synchronize()
        except Exception as exc:  # surfaced below: a thread's exception is lost
            errors.append(exc)

    t = threading.Thread(target=copy)
    t.start()
    t.join()
    assert not errors
    assert same(target.index_select(bd, torch.tensor([0, 1, 2, 3], device="cuda")),
                layer.index_select(bd, torch.tensor([0, 1, 2, 3], device="cuda")))
