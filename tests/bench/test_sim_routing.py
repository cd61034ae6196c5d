"""The routing simulator runs the router's own policies (issue 45 item 2), not copies."""

from __future__ import annotations

import random

import pytest

from benchmarks.sim.cluster import ARMS, BLOCK, Cluster, Request, SimConfig
from benchmarks.sim.routing import POLICIES
from kvcentric.router import policies
from kvcentric.router.policies import RouteInput
from kvcentric.router.policies.base import decision_for


def trace(n: int = 300, seed: int = 0) -> list[Request]:
    """``n`` requests, most over a few shared prefixes, arriving a little faster than three
    prefill instances serve them blind to where the KV is."""
    rnd = random.Random(seed)
    reqs = []
    for i in range(n):
        root = rnd.randrange(6) * 100 if rnd.random() < 0.7 else 10_000 + i * 100
        blocks = tuple(root + k for k in range(rnd.randrange(2, 12)))
        reqs.append(Request(i * 0.05, len(blocks) * BLOCK + 100, 50, blocks))
    return reqs


CFG = SimConfig(prefill=3, decode=2, local_blocks=40, store_blocks=400, slo_ttft=1.0)


def test_every_arm_is_a_registered_router_policy() -> None:
    assert set(POLICIES) == set(ARMS)
    for name, arm in ARMS.items():
        c = Cluster(CFG, name)
        assert type(c.policy) is policies.POLICIES[arm.policy], name
        outs = c.run(trace())
        assert len(outs) == 300, name
        served = [o for o in outs if o.ttft is not None]
        assert served and all(o.ttft > 0 for o in served), name
        if arm.policy != "algorithm1":
            assert len(served) == 300, name  # only Algorithm 1 refuses


def test_the_store_arm_hits_more_than_blind_routing_and_algorithm1_refuses_late_ones() -> None:
    runs = {name: Cluster(CFG, name).run(trace()) for name in ("random", "kvcentric")}

    def hits(name: str) -> int:
        return sum(o.local_tokens for o in runs[name] if o.ttft is not None)

    def met(name: str) -> int:
        return sum(o.met for o in runs[name])

    assert hits("kvcentric") > hits("random")
    assert met("kvcentric") > met("random")
    assert any(o.ttft is None for o in runs["kvcentric"])


def test_a_policy_registered_in_the_router_runs_in_the_simulator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class First:
        def __init__(self, rng: random.Random) -> None:
            self.seen = 0

        def choose(self, inp: RouteInput):  # type: ignore[no-untyped-def]
            self.seen += 1
            return decision_for(inp, inp.prefill[0], inp.decode[0])

    monkeypatch.setitem(policies.POLICIES, "first", First)
    monkeypatch.setitem(ARMS, "first", ARMS["random"].__class__("first"))
    c = Cluster(CFG, "first")
    outs = c.run(trace(50))
    assert isinstance(c.policy, First) and c.policy.seen == 50 and len(outs) == 50
