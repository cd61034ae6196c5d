"""PagePlan: engine pages <-> store objects, bit-exact, over runs and scattered objects."""

import ctypes

import pytest
import torch

from kvcentric.connector.vllm.mover import SKIP, ObjectGeometry, PagePlan, find_runs

LAYERS, PAGES, BLOCKS = 3, 2, 10
PAGE_SHAPE = (2, 4, 16)  # [num_kv_heads, block_size, 2*head_size], like vLLM CPU
PAGE_BYTES = 2 * 4 * 16 * 4  # float32


def kv_layers() -> list[torch.Tensor]:
    n = BLOCKS * 2 * 4 * 16
    return [torch.arange(i * n, (i + 1) * n, dtype=torch.float32).view(BLOCKS, *PAGE_SHAPE)
            for i in range(LAYERS)]


def test_find_runs() -> None:
    assert find_runs([0, 100, 200, 300], 100) == [(0, 4, 100)]
    assert find_runs([0, 128, 256, 1000, 1100], 100) == [(0, 3, 128), (3, 5, 100)]
    assert find_runs([0, 50], 100) == [(0, 1, 100), (1, 2, 100)]  # overlap never joins
    assert find_runs([500, 0], 100) == [(0, 1, 100), (1, 2, 100)]
    assert find_runs([], 100) == []


@pytest.mark.parametrize("layout", ["run", "strided-run", "scattered"])
def test_pack_then_unpack_round_trip(layout: str) -> None:
    geo = ObjectGeometry(LAYERS, PAGES, PAGE_BYTES)
    size = geo.object_bytes
    arena = ctypes.create_string_buffer(8 * size + 4096)
    base = ctypes.addressof(arena)
    offsets = {"run": [0, size, 2 * size], "strided-run": [0, size + 64, 2 * size + 128],
               "scattered": [5 * size, 0, 2 * size + 64]}[layout]
    ptrs = [base + o for o in offsets]
    pages = [[3, 7], [1, 2], [9, 0]]
    src = kv_layers()
    plan = PagePlan(geo, ptrs, pages)
    for layer, kv in enumerate(src):
        plan.pack_layer(layer, kv)
    mem = torch.frombuffer(arena, dtype=torch.uint8)
    for obj, off in enumerate(offsets):  # object layout [layer][page][bytes]
        o = mem[off:off + size].view(torch.float32).view(LAYERS, PAGES, *PAGE_SHAPE)
        for layer in range(LAYERS):
            for j in range(PAGES):
                assert torch.equal(o[layer, j], src[layer][pages[obj][j]])
    dst = [torch.zeros_like(t) for t in src]
    for layer, kv in enumerate(dst):
        plan.unpack_layer(layer, kv)
    touched = sorted(p for ps in pages for p in ps)
    untouched = [b for b in range(BLOCKS) if b not in touched]
    for layer in range(LAYERS):
        assert torch.equal(dst[layer][touched], src[layer][touched])
        assert not dst[layer][untouched].any()
    assert sorted(plan.page_ids()) == touched


def test_skipped_pages_are_left_alone() -> None:
    geo = ObjectGeometry(LAYERS, PAGES, PAGE_BYTES)
    arena = ctypes.create_string_buffer(2 * geo.object_bytes)
    base = ctypes.addressof(arena)
    src = kv_layers()
    PagePlan(geo, [base, base + geo.object_bytes], [[4, 5], [6, 8]]).pack_layer(1, src[1])
    dst = torch.full_like(src[1], -1.0)
    PagePlan(geo, [base, base + geo.object_bytes], [[SKIP, 5], [6, 8]]).unpack_layer(1, dst)
    assert (dst[4] == -1).all()  # the engine's own page is not overwritten
    assert torch.equal(dst[[5, 6, 8]], src[1][[5, 6, 8]])


def test_bad_plans() -> None:
    geo = ObjectGeometry(LAYERS, PAGES, PAGE_BYTES)
    with pytest.raises(ValueError):
        PagePlan(geo, [0], [[1]])
    with pytest.raises(ValueError):
        PagePlan(geo, [0, 1], [[1, 2]])
