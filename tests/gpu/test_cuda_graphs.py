"""What a full CUDA graph does to the connector's layer hooks, and why our path stays exact.

vLLM's default ``FULL_AND_PIECEWISE`` replays uniform decode batches (a P/D decode that
loaded ``prompt_len - 1`` tokens is one) as one captured graph. The connector's hooks run
around each attention op (``maybe_transfer_kv_layer``) only while connector metadata is
bound, which it never is during capture, and a replay runs no Python: so in such a step
``wait_for_layer_load`` and ``save_kv_layer`` never run. The worker then loads every
layer in ``start_load(hooks_run=False)`` (before the replay) and saves every layer in
``finish_step`` (after it).

Here a forward stand-in with vLLM's hook placement (attention reads the prefix's pages,
writes this step's KV into its page, hooks before and after) is captured in a real
``torch.cuda.CUDAGraph`` and replayed in a step that loads a prefix from the store and
saves the step's block: no hook runs during the replay, the replay reads exactly the
loaded KV (its output is bit-identical to an eager forward over the same pages), and
the saved object holds what the replay wrote.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvcentric.config import StoreConfig
from kvcentric.connector.vllm.transfers import StepPlan
from kvcentric.connector.vllm.worker import KVCentricWorker
from tests.helpers.kv_worker import (
    BS,
    LAYERS,
    SHAPES,
    D,
    H,
    caches,
    load,
    refs,
    save,
    spec,
    worker,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAYOUT = "flash_attn"  # [2, num_blocks, block_size, heads, head_dim]: block dim 1
READ = [[0, 1], [2, 3]]  # the loaded prefix's pages (two stored objects of two pages)
WRITE = [[4, 5]]  # the pages this step writes (one object, saved at the step's end)


class Hooks:
    """vLLM's ``maybe_transfer_kv_layer`` around one attention op: the connector's layer
    hooks run only while connector metadata is bound (never during graph capture)."""

    def __init__(self, w: KVCentricWorker) -> None:
        self.worker = w
        self.bound = False
        self.calls = 0

    def before(self, name: str) -> None:
        if self.bound:
            self.calls += 1
            self.worker.wait_for_layer(name)

    def after(self, name: str, kv: torch.Tensor) -> None:
        if self.bound:
            self.calls += 1
            self.worker.save_layer(name, kv)


def forward(hooks: Hooks, kv: dict[str, torch.Tensor], x: torch.Tensor, read: torch.Tensor,
            write: torch.Tensor) -> torch.Tensor:
    """Per layer: the hook, attention reading the prefix's pages (``read``) and writing
    this step's KV (``x`` scaled per layer) into its pages (``write``), the hook. Static
    shapes and buffers, as a captured graph needs."""
    h = torch.zeros((), device="cuda")
    for i, (name, layer) in enumerate(kv.items()):
        hooks.before(name)
        h = h + layer.index_select(1, read).float().sum() * (i + 1)
        layer.index_copy_(1, write, x * (i + 1))
        hooks.after(name, layer)
    return h


def gaussian(seed: int) -> dict[str, torch.Tensor]:
    """Finite values (random bit patterns hold NaNs, which no sum can compare)."""
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.attn":
            torch.randn(SHAPES[LAYOUT][0], generator=gen).to(torch.bfloat16).cuda()
            for i in range(LAYERS)}


@pytest.fixture
def store(store_cfg: StoreConfig) -> Iterator[StoreConfig]:
    yield store_cfg


def test_a_full_graph_replay_runs_no_hooks_and_reads_exactly_the_loaded_kv(
        store: StoreConfig) -> None:
    src = gaussian(1)
    prefix = refs("prefix", len(READ))
    writer = worker(store, LAYOUT, src)
    try:
        save(writer, src, StepPlan(saves=[spec("p", prefix, READ)], commit_now=True))
    finally:
        writer.close()

    kv = caches(LAYOUT, "cuda", seed=None)
    reader = worker(store, LAYOUT, kv)
    hooks = Hooks(reader)
    x = torch.zeros((2, len(WRITE[0]), BS, H, D), dtype=torch.bfloat16, device="cuda")
    read = torch.tensor([p for ps in READ for p in ps], device="cuda")
    write = torch.tensor(WRITE[0], device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up as vLLM does, then capture (no metadata bound)
        forward(hooks, kv, x, read, write)
        with torch.cuda.graph(graph):
            out = forward(hooks, kv, x, read, write)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for layer in kv.values():
        layer.zero_()
    assert hooks.calls == 0

    # the step: metadata bound, loads before the replay, the replay, saves after it
    step_x = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(x)
    block = refs("step", 1)
    try:
        hooks.bound = True
        reader.plan_saves(StepPlan(saves=[spec("w", block, WRITE)], commit_now=True))
        reader.start_load(StepPlan(loads=[spec("r", prefix, READ)]), hooks_run=False)
        x.copy_(step_x)
        graph.replay()
        reader.finish_step()
        hooks.bound = False
        torch.cuda.synchronize()
        assert hooks.calls == 0  # the replay ran none of the hooks
        assert reader.take_load_errors() == set()
        assert reader.stats.data["graph_steps"] == 1 and reader.stats.data["saved_blocks"] == 1
    finally:
        reader.close()

    # an eager forward over the same pages, copied by hand, computes the same bits
    ref = caches(LAYOUT, "cuda", seed=None)
    for name in ref:
        for p in (p for ps in READ for p in ps):
            ref[name][:, p] = src[name][:, p]
    want = forward(Hooks(reader), ref, step_x, read, write)
    torch.cuda.synchronize()
    assert torch.equal(out, want)

    # the object saved after the replay holds what the replay wrote
    got = caches(LAYOUT, "cuda", seed=None)
    check = worker(store, LAYOUT, got)
    try:
        assert load(check, got, StepPlan(loads=[spec("c", block, WRITE)])) == set()
    finally:
        check.close()
    torch.cuda.synchronize()
    for i, name in enumerate(got):
        for j, p in enumerate(WRITE[0]):
            assert torch.equal(got[name][:, p], (step_x * (i + 1))[:, j])
