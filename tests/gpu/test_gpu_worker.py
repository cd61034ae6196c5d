"""The real ``KVCentricWorker`` on vLLM-shaped caches and a real local store: pages saved
by one worker load bit-exact into another worker's zeroed cache, for every layout vLLM
allocates (no vLLM needed: the worker data path does not import it).

Runs on CPU (layouts, block dims, the worker's plumbing) and, marked ``gpu``, on CUDA:
pinned store memory, staged copies (HBM gather, 2-D DMA), the copy stream ordered by
events. A forward-pass stand-in writes each layer right before its save behind a long GPU
sleep, so a pack that did not wait for the compute stream would store stale bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvcentric.config import StoreConfig
from kvcentric.connector.vllm.engine_layout import EngineLayout
from kvcentric.connector.vllm.mover import SKIP, ObjectGeometry
from kvcentric.connector.vllm.settings import ConnectorSettings
from kvcentric.connector.vllm.transfers import StepPlan, TransferSpec
from kvcentric.connector.vllm.worker import KVCentricWorker
from kvcentric.hashing import KeySpace
from kvcentric.store import open_store
from kvcentric.stored_layout import KVLayout

LAYERS, NB, BS, H, D, K = 3, 24, 16, 2, 32, 2  # layers, blocks, page tokens, heads, dim, k
SHAPES = {  # vLLM's per-layer KV cache shapes (and block dim)
    "flash_attn": ((2, NB, BS, H, D), 1),
    "flashinfer": ((NB, 2, BS, H, D), 0),
    "mla": ((NB, BS, 576), 0),
    "cpu": ((NB, H, BS, 2 * D), 0),
}
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


def page_bytes(layout: str) -> int:
    shape, bd = SHAPES[layout]
    return torch.Size(shape).numel() // shape[bd] * 2  # bfloat16


def engine(layout: str) -> EngineLayout:
    mla = layout == "mla"
    kv = KVLayout(num_layers=LAYERS, block_size=BS * K, num_kv_heads=1 if mla else H,
                  head_dim=576 if mla else D, dtype="bfloat16", layout=f"test:{layout}", mla=mla)
    return EngineLayout(kv, ObjectGeometry(LAYERS, K, page_bytes(layout)),
                        KeySpace("gpu-test", kv.signature()), BS)


def caches(layout: str, device: str, seed: int | None) -> dict[str, torch.Tensor]:
    """Random bit patterns (``seed``) or zeros, one tensor per layer, in ``layout``."""
    shape, _ = SHAPES[layout]
    gen = torch.Generator().manual_seed(seed or 0)
    out = {}
    for i in range(LAYERS):
        bits = (torch.randint(-2**15, 2**15, shape, dtype=torch.int16, generator=gen)
                if seed is not None else torch.zeros(shape, dtype=torch.int16))
        out[f"model.layers.{i}.attn"] = bits.view(torch.bfloat16).to(device)
    return out


def page(kv: torch.Tensor, layout: str, block: int) -> torch.Tensor:
    _, bd = SHAPES[layout]
    return kv.select(bd, block).view(torch.int16).cpu()


@pytest.fixture
def store(store_cfg: StoreConfig) -> Iterator[StoreConfig]:
    yield store_cfg


def worker(cfg: StoreConfig, layout: str, kv: dict[str, torch.Tensor]) -> KVCentricWorker:
    w = KVCentricWorker(ConnectorSettings(store=cfg), engine(layout), open_store(cfg),
                        list(kv))
    w.register(kv)
    return w


def spec(req: str, keys: list[str], pages: list[list[int]]) -> TransferSpec:
    return TransferSpec(req, keys, pages, [None, *keys[:-1]])


def save(w: KVCentricWorker, kv: dict[str, torch.Tensor], plan: StepPlan,
         before_save: Any = None) -> None:
    w.plan_saves(plan)
    for i, (name, layer) in enumerate(kv.items()):
        if before_save is not None:
            before_save(i, layer)  # the forward writes this layer, then the hook saves it
        w.save_layer(name, layer)
    w.finish_step()


def load(w: KVCentricWorker, kv: dict[str, torch.Tensor], plan: StepPlan) -> set[int]:
    w.start_load(plan)
    for name in kv:
        w.wait_for_layer(name)
    w.finish_step()
    return w.take_load_errors()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(SHAPES))
def test_saved_pages_load_bit_exact_into_another_cache(store: StoreConfig, layout: str,
                                                        device: str) -> None:
    src_kv, dst_kv = caches(layout, device, seed=1), caches(layout, device, seed=None)
    keys = [f"{engine(layout).keyspace.prefix}obj{i}" for i in range(3)]
    src_pages = [[5, 9], [0, 23], [12, 7]]
    dst_pages = [[1, 2], [3, 4], [SKIP, 6]]  # the engine already has one page: untouched
    src, dst = worker(store, layout, src_kv), worker(store, layout, dst_kv)
    try:
        save(src, src_kv, StepPlan(saves=[spec("r1", keys, src_pages)], commit_now=True))
        assert src.stats.data["saved_blocks"] == 3
        if device == "cuda":  # load under another compute stream than the default one
            with torch.cuda.stream(torch.cuda.Stream()):
                errors = load(dst, dst_kv, StepPlan(loads=[spec("r2", keys, dst_pages)]))
            torch.cuda.synchronize()
        else:
            errors = load(dst, dst_kv, StepPlan(loads=[spec("r2", keys, dst_pages)]))
    finally:
        src.close()
        dst.close()
    assert errors == set()
    for name in src_kv:
        for sp, dp in zip(src_pages, dst_pages, strict=True):
            for s, d in zip(sp, dp, strict=True):
                if d != SKIP:
                    assert torch.equal(page(dst_kv[name], layout, d),
                                       page(src_kv[name], layout, s))
        untouched = [b for b in range(NB) if b not in {p for ps in dst_pages for p in ps}]
        assert all(not page(dst_kv[name], layout, b).any() for b in untouched)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "mla"])
def test_saves_wait_for_the_layer_written_by_the_forward(store: StoreConfig,
                                                         layout: str) -> None:
    kv = caches(layout, "cuda", seed=None)
    keys = [f"{engine(layout).keyspace.prefix}ord{i}" for i in range(4)]
    pages = [[2 * i, 2 * i + 1] for i in range(4)]
    w = worker(store, layout, kv)
    compute = torch.cuda.Stream()

    def forward(i: int, layer: torch.Tensor) -> None:
        torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time before the write lands
        layer.fill_(float(i + 1))

    try:
        with torch.cuda.stream(compute):
            save(w, kv, StepPlan(saves=[spec("r", keys, pages)], commit_now=True), forward)
        got = caches(layout, "cuda", seed=None)
        reader = worker(store, layout, got)
        assert load(reader, got, StepPlan(loads=[spec("r2", keys, pages)])) == set()
        reader.close()
    finally:
        w.close()
    torch.cuda.synchronize()
    for i, name in enumerate(got):
        want = torch.full_like(got[name].select(SHAPES[layout][1], 0), float(i + 1))
        for block in range(8):
            assert torch.equal(got[name].select(SHAPES[layout][1], block), want), (name, block)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_worker_pins_the_store_arena_and_stages_copies(store: StoreConfig) -> None:
    kv = caches("flash_attn", "cuda", seed=3)
    w = worker(store, "flash_attn", kv)
    try:
        path = w._path
        assert path.pinner is not None and path.pinner.registered_bytes >= store.capacity_bytes
        assert path.ordering is not None and path.kernel.block_dim == 1
        assert path.kernel.staged  # gathered in HBM, one DMA per object and layer
        assert path.kernel.pack_impl == path.kernel.unpack_impl == "auto"  # torch in HBM
    finally:
        w.close()
    assert path.pinner.registered_bytes == 0  # unregistered before the arena is unmapped
