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

from benchmarks.emulator.launch import EmulatedFleet
from benchmarks.serving.compare import POLICY_ARMS
from tests.helpers.emulated_fleet import fleet as emulated_fleet
from tests.helpers.emulated_fleet import router


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmulatedFleet, Path]]:
    logs = tmp_path_factory.mktemp("policy-fleet")
    with emulated_fleet(logs, 3) as f:
        yield f, logs


def prefills(f: EmulatedFleet, logs: Path, policy: str) -> list[str]:
    """The prefill engine of six requests sharing a 1024-token prefix, one at a time."""
    g = router(f, logs, tag=f"-{policy}", policy=policy)
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
