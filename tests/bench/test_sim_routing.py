"""The routing simulator runs the router's own policies (issue 45 item 2), not copies."""

from __future__ import annotations

import random

import pytest

from benchmarks.sim.cluster import ARMS, BLOCK, Cluster, Request, SimConfig, TieredStore
from benchmarks.sim.routing import POLICIES
from kvcentric.router import policies
from kvcentric.router.cost.decision import Rejection
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


def test_the_store_demotes_what_dram_evicts_to_disk_and_promotes_what_is_read() -> None:
    st = TieredStore(dram_blocks=3, disk_blocks=4)
    st.add([1, 2, 3])
    st.add([4, 5])  # a chain's leaves leave first: 3, then 2, go to disk
    assert st.run([1, 2, 3, 4, 5, 9]) == 5
    assert st.disk_only([1, 2, 3, 4, 5], 5) == [1, 2]
    st.add([1, 2])  # a read promotes 2; DRAM's least recent (5) goes down
    assert st.disk_only([1, 2, 3, 4, 5], 5) == [2, 4]
    assert st.disk is not None and set(st.disk.d) == {3, 5} and set(st.dram.d) == {1, 2, 4}
    dram_only = TieredStore(dram_blocks=2, disk_blocks=0)
    dram_only.add([1, 2, 3])
    assert dram_only.run([1, 2, 3]) == 2 and dram_only.disk_only([1, 2, 3], 2) == []


def test_disk_loads_take_the_disk_bandwidth_and_only_a_tier_aware_router_knows() -> None:
    cfg = SimConfig(prefill=2, decode=1, store_blocks=4, disk_blocks=64, disk_bw=1e9)
    per = BLOCK * cfg.kv_bytes_per_token
    assert cfg.load_s(4, on_disk=3) == pytest.approx(per / cfg.store_bw + 3 * per / 1e9)
    aware, blind = Cluster(cfg, "kvcentric"), Cluster(cfg, "kvcentric_tierblind")
    assert aware.params.disk_bandwidth_bps == 1e9
    assert blind.params.disk_bandwidth_bps is None
    prefix = tuple(range(8))
    for c in (aware, blind):
        c.store.add(prefix)  # 8 blocks through a 4-block DRAM: the leaves go to disk
        assert c.store.disk_only(prefix, 8) == [4, 5, 6, 7]
    req = Request(0.0, 8 * BLOCK + 10, 4, prefix)
    da, db = aware.choose(req, 0.0), blind.choose(req, 0.0)
    assert not isinstance(da, Rejection) and not isinstance(db, Rejection)
    assert da.load_on_disk == 4 and da.load_s == pytest.approx(cfg.load_s(8, 4))
    assert db.load_s == pytest.approx(cfg.load_s(8))  # priced as DRAM: too low


def test_a_hot_new_prefixs_followers_wait_for_it_to_land_instead_of_computing_it() -> None:
    """A new 16-block prefix, then a burst of requests sharing it while its first prefill
    runs. The router with landings holds the ones its holder should not queue until the
    prefix is stored, then loads it on the other instances: no request after the first
    computes it. Without landings some compute it again (on an otherwise idle fleet that
    is sooner for them; the capacity sweeps weigh the compute it takes from others)."""
    prefix = tuple(range(16))
    reqs = [Request(0.0, 16 * BLOCK + 2048, 10, prefix)]
    reqs += [Request(0.05 + 0.01 * i, 16 * BLOCK + 2048, 10, prefix) for i in range(12)]
    cfg = SimConfig(prefill=4, decode=2, local_blocks=64, store_blocks=400, slo_ttft=30.0,
                    noise=0.0)
    runs = {name: Cluster(cfg, name).run(reqs)
            for name in ("kvcentric_noreject_landing", "kvcentric_noreject")}
    cold = {name: sum(o.hit_tokens < 16 * BLOCK for o in outs) for name, outs in runs.items()}
    assert cold["kvcentric_noreject_landing"] == 1, cold  # the first request only
    assert cold["kvcentric_noreject"] > 1, cold
