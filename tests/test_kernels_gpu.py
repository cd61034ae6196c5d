"""GPU tests for ``kernels``: torch and Triton paths on CUDA tensors, and rows
in pinned / pageable host memory. Marked ``gpu``; skipped without CUDA.

Helpers (layouts, bit-exact comparison) come from ``tests/test_kernels.py``.
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
    unpack_blocks,
    unpack_blocks_layers,
)
from tests.test_kernels import (
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
