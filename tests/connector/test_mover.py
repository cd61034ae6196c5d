"""PagePlan: engine pages <-> store objects, bit-exact, over runs and scattered objects."""

import ctypes

import pytest
import torch

from kvcentric.connector.vllm.mover import (
    SKIP,
    ObjectGeometry,
    PageKernel,
    PagePlan,
    block_dim_of,
    find_runs,
)

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
    for obj, off in enumerate(offsets):  # object layout [header][layer][page][bytes]
        o = mem[off + geo.header_bytes:off + size].view(torch.float32).view(
            LAYERS, PAGES, *PAGE_SHAPE)
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


@pytest.mark.parametrize(("shape", "dim"), [
    ((2, 10, 16, 4, 8), 1),  # FlashAttention [2, num_blocks, block_size, heads, dim]
    ((10, 2, 16, 4, 8), 0),  # FlashInfer [num_blocks, 2, ...]
    ((10, 16, 576), 0),      # MLA
    ((10, 4, 16, 16), 0),    # vLLM CPU
    ((4, 4, 16, 16), 0),     # as many blocks as heads: dim 0 still the only sane reading
])
def test_block_dim_of_vllm_layouts(shape: tuple[int, ...], dim: int) -> None:
    layer = torch.empty(shape, dtype=torch.bfloat16)
    assert block_dim_of(layer, layer.numel() // shape[dim] * 2) == dim


def test_block_dim_of_rejects_what_it_cannot_tell() -> None:
    with pytest.raises(ValueError, match="cannot tell"):
        block_dim_of(torch.empty(2, 2, 16, 8), 16 * 8 * 2 * 4)  # K/V or two blocks?
    with pytest.raises(ValueError, match="cannot tell"):
        block_dim_of(torch.empty(10, 16, 8), 12345)


@pytest.mark.parametrize("impl", ["torch", "dma"])
def test_flash_layout_round_trip_with_block_dim_1(impl: str) -> None:
    """A FlashAttention layer keeps K and V of a block apart; an object page holds both."""
    nb = 6
    layers = [torch.arange(2 * nb * 32, dtype=torch.float32).view(2, nb, 4, 8) + 1000 * i
              for i in range(LAYERS)]
    geo = ObjectGeometry(LAYERS, PAGES, 2 * 32 * 4)
    arena = ctypes.create_string_buffer(2 * geo.object_bytes)
    ptrs = [ctypes.addressof(arena), ctypes.addressof(arena) + geo.object_bytes]
    kernel = PageKernel(block_dim=1, pack_impl=impl, unpack_impl=impl)
    for i, layer in enumerate(layers):
        PagePlan(geo, ptrs, [[4, 1], [0, 5]], kernel).pack_layer(i, layer)
    dst = [torch.zeros_like(t) for t in layers]
    for i, layer in enumerate(dst):
        PagePlan(geo, ptrs, [[0, 1], [2, SKIP]], kernel).unpack_layer(i, layer)
    for src, got in zip(layers, dst, strict=True):
        for s, d in ((4, 0), (1, 1), (0, 2)):
            assert torch.equal(got[:, d], src[:, s])
        assert not got[:, 3:].any()  # SKIP and unlisted blocks untouched



def test_grouped_copies_split_at_each_change_of_kv_cache_group() -> None:
    """A multi-layer transfer moves layers with one set of page ids: with a hybrid
    model's interleaved groups it splits where the group changes (one range per run of a
    group's consecutive layers); one group keeps the whole range."""
    geo = ObjectGeometry(5, PAGES, PAGE_BYTES)
    hybrid = PagePlan(geo, [0], [[0] * 4], PageKernel(), [1, 0, 0, 1, 1])
    assert hybrid._spans(0, 5) == [(0, 1), (1, 3), (3, 5)]
    assert hybrid._spans(2, 3) == [(2, 3), (3, 5)]
    assert PagePlan(geo, [0], [[0] * 2])._spans(1, 4) == [(1, 5)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_copies_use_each_layers_own_page_ids() -> None:
    """A hybrid model's layers take their pages from their own group's block table
    (``layer_groups``); the staged multi-layer copies (``pack_layers`` / ``unpack_layers``)
    give the same bytes as the per-layer path, SKIP pages left alone."""
    layers, groups = 5, [1, 0, 0, 1, 1]  # interleaved, as model order makes them
    n = BLOCKS * 2 * 4 * 16
    src = [torch.arange(i * n, (i + 1) * n, dtype=torch.float32).view(BLOCKS, *PAGE_SHAPE)
           for i in range(layers)]
    geo = ObjectGeometry(layers, PAGES, PAGE_BYTES)
    pages = [[3, 7, 1, 2], [9, 0, 4, 5]]  # per object: group 0's two pages, then group 1's
    staged = PageKernel(staged=True)
    assert PagePlan(geo, [0], [[0] * 4], staged, groups).grouped()
    arenas = [ctypes.create_string_buffer(2 * geo.object_bytes) for _ in range(2)]
    ptrs = [[ctypes.addressof(a), ctypes.addressof(a) + geo.object_bytes] for a in arenas]
    PagePlan(geo, ptrs[0], pages, staged, groups).pack_layers(0, [t.cuda() for t in src])
    torch.cuda.synchronize()
    ref = PagePlan(geo, ptrs[1], pages, PageKernel(), groups)
    for layer, kv in enumerate(src):
        ref.pack_layer(layer, kv)
    assert arenas[0].raw == arenas[1].raw
    mem = torch.frombuffer(arenas[0], dtype=torch.uint8)
    o = mem[geo.header_bytes:geo.object_bytes].view(torch.float32).view(
        layers, PAGES, *PAGE_SHAPE)
    for layer in range(layers):  # object 0: each layer's pages from its own group's ids
        g = groups[layer]
        for j in range(PAGES):
            assert torch.equal(o[layer, j], src[layer][pages[0][g * PAGES + j]])
    load = [[SKIP, 7, 1, SKIP], [9, 0, 4, 5]]  # a hit's own pages and a window's edge
    dst = [torch.full_like(t, -1.0).cuda() for t in src]
    PagePlan(geo, ptrs[0], load, staged, groups).unpack_layers(0, dst)
    torch.cuda.synchronize()
    for layer in range(layers):
        g, got = groups[layer], dst[layer].cpu()
        want = {b for p in load for b in p[g * PAGES:(g + 1) * PAGES] if b != SKIP}
        for b in range(BLOCKS):
            if b in want:
                assert torch.equal(got[b], src[layer][b])
            else:
                assert (got[b] == -1).all()


def test_a_plan_checks_each_pages_ids_once_for_every_layer_of_one_shape(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step moves the same pages of every layer: the ids of each (run, page) are checked
    on the first layer of a shape and reused, for packing and unpacking alike; a layer of
    another shape (a hybrid model's other KV cache group) gets its own check, and the
    bytes are those of a plan that checks every layer."""
    from kvcentric.kernels import dispatch

    checked = []
    real = dispatch.normalize_ids
    monkeypatch.setattr(dispatch, "normalize_ids",
                        lambda *a, **k: checked.append(1) or real(*a, **k))
    geo = ObjectGeometry(LAYERS, PAGES, PAGE_BYTES)
    arena = ctypes.create_string_buffer(2 * geo.object_bytes)
    base = ctypes.addressof(arena)
    ptrs, pages = [base, base + geo.object_bytes], [[3, 7], [1, 2]]
    src = kv_layers()
    plan = PagePlan(geo, ptrs, pages)  # one run of two objects: PAGES kernel calls a layer
    for layer, kv in enumerate(src):
        plan.pack_layer(layer, kv)
    assert len(checked) == PAGES
    dst = [torch.zeros_like(t) for t in src]
    for layer, kv in enumerate(dst):
        plan.unpack_layer(layer, kv)
    assert len(checked) == 2 * PAGES
    for layer in range(LAYERS):
        assert torch.equal(dst[layer][[3, 7, 1, 2]], src[layer][[3, 7, 1, 2]])
    wider = torch.zeros(BLOCKS + 2, *PAGE_SHAPE)  # same pages, more blocks: checked anew
    plan.unpack_layer(0, wider)
    assert len(checked) == 3 * PAGES
    assert torch.equal(wider[[3, 7, 1, 2]], src[0][[3, 7, 1, 2]])
    with pytest.raises(ValueError):  # a layer too small for the ids: refused, not copied
        plan.unpack_layer(0, torch.zeros(5, *PAGE_SHAPE))
