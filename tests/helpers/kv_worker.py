"""The worker data path on vLLM-shaped caches, without vLLM: layouts, caches, plans, and
one save or load step as vLLM's model runner drives it (tests/gpu)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import xxhash

from kvcentric.config import StoreConfig
from kvcentric.connector.vllm.engine_layout import EngineLayout
from kvcentric.connector.vllm.mover import ObjectGeometry
from kvcentric.connector.vllm.settings import ConnectorSettings
from kvcentric.connector.vllm.transfers import StepPlan, TransferSpec
from kvcentric.connector.vllm.worker import KVCentricWorker
from kvcentric.hashing import KeySpace
from kvcentric.integrity import ObjectRef
from kvcentric.store import open_store
from kvcentric.stored_layout import KVLayout
from tests.helpers.waiting import wait_until

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


def worker(cfg: StoreConfig, layout: str, kv: dict[str, torch.Tensor],
           rank: int | None = None) -> KVCentricWorker:
    """A worker of ``layout``; ``rank``: TP rank ``rank`` of 2 (None: TP 1)."""
    eng = engine(layout)
    if rank is not None:
        eng = replace(eng, keyspace=replace(eng.keyspace, tp_rank=rank, tp_size=2))
    w = KVCentricWorker(ConnectorSettings(store=cfg), eng, open_store(cfg), list(kv))
    w.register(kv)
    return w


def refs(tag: str, n: int) -> list[ObjectRef]:
    """``n`` objects of a made-up prompt ``tag`` (digests stand in for chain hashes)."""
    return [ObjectRef(xxhash.xxh3_128_digest(f"{tag}-{i}".encode()), i, BS * K)
            for i in range(n)]


def spec(req: str, objs: list[ObjectRef], pages: list[list[int]]) -> TransferSpec:
    return TransferSpec(req, objs, pages, [None, *objs[:-1]])


def stored(cfg: StoreConfig, layout: str, tag: str, n: int, device: str = "cpu",
           seed: int = 3) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """Save ``n`` objects of ``tag`` from a random cache (``seed``) of ``layout``, pages
    ``[2i + 1, 2i + 2]``: (that cache, those pages)."""
    kv = caches(layout, device, seed=seed)
    pages = [[2 * i + 1, 2 * i + 2] for i in range(n)]
    w = worker(cfg, layout, kv)
    try:
        save(w, kv, StepPlan(saves=[spec("src", refs(tag, n), pages)], commit_now=True))
        assert w.stats.data["saved_blocks"] == n
    finally:
        w.close()
    return kv, pages


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


def transfers(w: KVCentricWorker, want: set[str], timeout: float = 10.0
              ) -> tuple[set[str], set[str]]:
    """``w``'s asynchronous load results, taken as vLLM takes them once per step, until
    every request in ``want`` is reported done: (done, failed as requests), accumulated."""
    done: set[str] = set()
    failed: set[str] = set()

    def step() -> bool:
        d, f = w.take_transfer_results()
        done.update(d)
        failed.update(f)
        return want <= done

    assert wait_until(step, timeout), f"{want - done} not reported done in {timeout} s"
    return done, failed


def same_pages(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], layout: str,
               got_pages: list[list[int]], want_pages: list[list[int]]) -> bool:
    return all(torch.equal(page(got[n], layout, g), page(want[n], layout, w))
               for n in got for gp, wp in zip(got_pages, want_pages, strict=True)
               for g, w in zip(gp, wp, strict=True))


def untouched(kv: dict[str, torch.Tensor]) -> bool:
    return all(not t.view(torch.int16).any() for t in kv.values())
