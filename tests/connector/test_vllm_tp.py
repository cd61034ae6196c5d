"""Tensor parallelism end to end: vLLM CPU servers with ``tensor_parallel_size=2`` (two
ranks, one core each) on a real local store answer exactly the tokens of a plain TP = 2
engine after cross-instance reuse (full blocks and tails) and a P/D handoff.

Each rank stores its own shard under its own keys (``.../0of2/...``, ``.../1of2/...``), the
scheduler counts a block only when both shards are stored, and each rank checks that the
objects it loads were written for its rank (integrity header). Before, both ranks saved
under rank 0's keys and a reader loaded one rank's shard into both: other tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import open_store
from kvcentric.store.local import launcher
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import VllmServer, connector_config
from tests.helpers.e2e_store import e2e_store

pytestmark = pytest.mark.vllm
TP = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (auto-binding asserts)
PROMPTS = {"tail": 1100, "blocks": 1025, "pd": 900}  # 1025: full blocks only, no tail


def prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(4, 4000) for _ in range(n)]


def server(model: str, log: Path, kv: dict[str, Any] | None = None) -> VllmServer:
    return VllmServer(model, args=TP, env=TP_ENV, log_path=log, kv_transfer=kv)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """A plain TP = 2 engine's tokens for every prompt (started alone, then stopped: three
    TP = 2 engines at once would not fit two cores well)."""
    model = str(build_model("tiny", Path.cwd() / ".models" / "tiny"))
    base = server(model, tmp_path_factory.mktemp("tp-logs") / "base.log")
    try:
        base.start().wait_ready()
        return {name: base.tokens(prompt(i, n), max_tokens=24)
                for i, (name, n) in enumerate(PROMPTS.items())}
    finally:
        base.stop()


@pytest.fixture(scope="module")
def pair(runtime_dir: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[VllmServer, VllmServer, dict[str, Any]]]:
    model = str(build_model("tiny", Path.cwd() / ".models" / "tiny"))
    store = e2e_store("vllm-tp", "256mb", runtime_dir)
    logs = tmp_path_factory.mktemp("tp-logs")
    writer = server(model, logs / "writer.log", connector_config(store))
    reader = server(model, logs / "reader.log", connector_config(store))
    try:
        for s in (writer, reader):
            s.start()
        for s in (writer, reader):
            s.wait_ready()
        yield writer, reader, store
    finally:
        writer.stop()
        reader.stop()
        launcher.stop(StoreConfig.from_dict(store))


def hits(server: VllmServer) -> float:
    return server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)


def test_tp2_reuse_across_instances_is_exact(
        reference: dict[str, list[int]],
        pair: tuple[VllmServer, VllmServer, dict[str, Any]]) -> None:
    writer, reader, store = pair
    for i, (name, n) in enumerate(PROMPTS.items()):
        if name == "pd":
            continue
        p = prompt(i, n)
        assert writer.tokens(p, max_tokens=24) == reference[name], name
        before = hits(reader)
        assert reader.tokens(p, max_tokens=24) == reference[name], name
        assert hits(reader) - before == n - 1, name  # blocks (and tail, if any) loaded
    with open_store(store) as st:  # both ranks' shards, each under its own keys
        ranks = {k.split("/")[4] for k in st.list_keys("kvc/v2/tiny/", 100000)}
    assert ranks == {"0of2", "1of2"}
    assert reader.metrics().get("vllm:kvcentric_integrity_errors_total", 0.0) == 0


def test_tp2_prefill_decode_handoff_is_exact(
        reference: dict[str, list[int]],
        pair: tuple[VllmServer, VllmServer, dict[str, Any]]) -> None:
    writer, reader, _ = pair
    p = prompt(list(PROMPTS).index("pd"), PROMPTS["pd"])
    writer.tokens(p, max_tokens=1)  # the prefill instance: its KV goes to the store
    before = hits(reader)
    assert reader.tokens(p, max_tokens=24) == reference["pd"]
    assert hits(reader) - before == len(p) - 1
