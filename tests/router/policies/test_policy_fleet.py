"""The emulated fleet's router arms run the router's policies (issue 45 item 2): our router
started by the benchmarks' gateway with ``policy: round_robin`` in front of emulated
engines sends a hot prefix's requests to every engine in turn (Algorithm 1 would keep
them on the engine holding it: tests/router/policies/test_policy_algorithm1.py)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.emulator.launch import EmulatedFleet, EmulatorSpec
from benchmarks.emulator.profile import EngineProfile
from benchmarks.serving.compare import POLICY_ARMS
from benchmarks.serving.gateways import kvcentric_router
from kvcentric.testing.models import build_model

FAST = EngineProfile("fast", "test", api_s=0.001, step_s=0.004, prefill_token_s=2e-5,
                     prefill_pair_s=1e-9, decode_seq_s=1e-4, decode_ctx_s=0.0)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmulatedFleet, Path]]:
    logs = tmp_path_factory.mktemp("policy-fleet")
    prof = logs / "fast.json"
    FAST.save(prof)
    tok = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    with EmulatedFleet(EmulatorSpec(3, tok, profile=str(prof), pages=256,
                                    max_model_len=8192), logs) as f:
        yield f, logs


def prefills(f: EmulatedFleet, logs: Path, policy: str) -> list[str]:
    """The prefill engine of six requests sharing a 1024-token prefix, one at a time."""
    insts = [{"url": s["url"], "name": s["name"], "kv_events": s["kv_events"]}
             for s in f.specs]
    g = kvcentric_router(model="bench", tokenizer=str(Path.cwd() / ".models" / "bench"),
                         worker_urls=f.urls, store=None, slo_ttft_ms=10_000,
                         slo_tpot_ms=1_000, logs=logs, reject=False, instances=insts,
                         tag=f"-{policy}", policy=policy)
    rnd = random.Random(policy)
    hot = [rnd.randrange(10, 8000) for _ in range(1024)]
    out = []
    try:
        g.start()
        g.wait_ready(120)
        for _ in range(6):
            r = httpx.post(g.url + "/v1/completions", timeout=60,
                           json={"model": "bench", "max_tokens": 2,
                                 "prompt": hot + [rnd.randrange(10, 8000) for _ in range(32)]})
            assert r.status_code == 200, r.text
            out.append(r.headers["x-kvc-prefill"])
    finally:
        g.stop()
    return out


def test_the_fleets_router_runs_the_configured_policy(
        fleet: tuple[EmulatedFleet, Path]) -> None:
    f, logs = fleet
    assert {a.gateway_opts["policy"] for a in POLICY_ARMS} >= {"round_robin", "engine_cache"}
    rr = prefills(f, logs, "round_robin")
    assert rr[:3] == rr[3:] and len(set(rr)) == 3  # every engine in turn
