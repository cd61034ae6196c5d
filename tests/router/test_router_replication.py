"""Hot-prefix replication: which prefix is shared, when an idle instance is worth warming,
the bounds, and (through the app, engines as httpx handlers) the warm request itself."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import numpy as np
import pytest

from kvcentric.router.conductor import Conductor
from kvcentric.router.config import RouterConfig
from kvcentric.router.cost.cost_model import Profile
from kvcentric.router.fleet.instance_spec import InstanceSpec
from kvcentric.router.fleet.replication import HotPrefixes, Replicator, warm_body
from kvcentric.router.fleet.store_view import StoreView
from kvcentric.router.ops.metrics import RouterMetrics
from kvcentric.router.tokenize import PromptTokenizer
from tests.router.test_router_app import TWO, Upstreams, make_cfg, run

BS = 256
PROFILE = Profile(a=0.0, b=1e-4, c=0.001)  # 256 tokens: ~26 ms


def toks(seed: int, n: int) -> np.ndarray:
    rnd = random.Random(seed)
    return np.array([rnd.randrange(4, 4000) for _ in range(n)], dtype=np.int64)


def test_the_shared_prefix_is_what_every_request_of_a_root_had_in_common() -> None:
    hp = HotPrefixes(capacity=2)
    system = toks(1, 3 * BS)
    c = Conductor(RouterConfig.from_dict({"model": "m", "tokenizer": "x",
                                          "keys": {"block_size": BS}}),
                  PROFILE, 1024, StoreView(None, "m"))
    first = np.concatenate([system, toks(2, 2 * BS)])
    second = np.concatenate([system, toks(3, 2 * BS + 7)])
    hp.observe(c.hashes(first), first, None, BS)
    root = c.hashes(first)[0]
    p = hp.get(root)
    assert p is not None and len(p.hashes) == 5 and p.requests == 1
    hp.observe(c.hashes(second), second, None, BS)
    assert p.hashes == c.hashes(system) and np.array_equal(p.tokens, system)
    assert p.requests == 2
    for seed in (4, 5):  # two other roots: the least recently seen root is dropped
        other = toks(seed, BS)
        hp.observe(c.hashes(other), other, "tenant", BS)
    assert hp.get(root) is None and len(hp) == 2


def conductor(compute: dict[str, str] | None = None,
              specs: dict[str, dict[str, Any]] | None = None,
              **replication: Any) -> tuple[Conductor, list[float]]:
    clock = [100.0]
    cfg = RouterConfig.from_dict({
        "model": "m", "tokenizer": "x", "keys": {"block_size": BS},
        "replication": {"min_heat": 3, **replication}})  # on by default
    c = Conductor(cfg, PROFILE, 1024, StoreView(None, "m"), clock=lambda: clock[0])
    for n in "abc":
        c.registry.add(InstanceSpec(url=f"http://{n}:1", name=n,
                                    compute=(compute or {}).get(n),
                                    **(specs or {}).get(n, {})))
    return c, clock


def hot(c: Conductor, rep: Replicator, holder: str, n_requests: int = 5) -> list[bytes]:
    """``n_requests`` requests sharing a 4-block prefix, all resident on ``holder``."""
    system = toks(7, 4 * BS)
    for i in range(n_requests):
        prompt = np.concatenate([system, toks(100 + i, BS + 3)])
        hashes = c.hashes(prompt)
        rep.observe(hashes, prompt, "t1")
        c.heat.touch(hashes[0], c.clock())
    inst = c.registry.get(holder)
    assert inst is not None
    shared = c.hashes(system)
    c.index.add(inst.slot, shared)
    return shared


def test_an_idle_instance_is_warmed_when_the_holder_is_busy() -> None:
    c, clock = conductor()
    rep = Replicator(c, RouterMetrics(c))
    shared = hot(c, rep, "a")
    assert rep.candidates(clock[0]) == []  # the holder is idle: nothing to gain
    a, b, cc = (c.registry.get(n) for n in "abc")
    assert a is not None and b is not None and cc is not None
    a.enqueue("busy", 2.0, clock[0])  # 2 s of prefill queued on the holder
    b.stats.waiting = 1  # b has requests waiting: not idle capacity
    (w,) = rep.candidates(clock[0])
    assert w.target is cc and w.prefix.hashes == shared and w.prefix.salt == "t1"
    assert w.holder_ttft_s > 2.0 > w.target_ttft_s
    body = warm_body("m", w.prefix)
    assert body["max_tokens"] == 1 and body["cache_salt"] == "t1"
    assert body["prompt"] == [int(t) for t in toks(7, 4 * BS)]
    # bounds: a replica per instance per cooldown; max_replicas holders; cold prefixes
    rep._warmed[(shared[0], "c")] = clock[0]
    assert rep.candidates(clock[0]) == []
    clock[0] += 31.0
    a.enqueue("busy2", 2.0, clock[0])
    assert [w.target.name for w in rep.candidates(clock[0])] == ["c"]
    # an instance sharing the busy holder's processor is no idle capacity
    c3, clock3 = conductor(compute={"a": "gpu0", "c": "gpu0"})
    rep3 = Replicator(c3, RouterMetrics(c3))
    hot(c3, rep3, "a")
    a3 = c3.registry.get("a")
    assert a3 is not None
    a3.enqueue("busy", 2.0, clock3[0])
    assert [w.target.name for w in rep3.candidates(clock3[0])] == ["b"]
    bounds: tuple[dict[str, Any], ...] = ({"max_replicas": 1}, {"min_heat": 50})
    for bound in bounds:  # one holder is enough; not hot
        c2, clock2 = conductor(**bound)
        rep2 = Replicator(c2, RouterMetrics(c2))
        hot(c2, rep2, "a")
        a2 = c2.registry.get("a")
        assert a2 is not None
        a2.enqueue("busy", 2.0, clock2[0])
        assert rep2.candidates(clock2[0]) == [], bound


def test_warm_ups_run_side_by_side_on_separate_idle_instances() -> None:
    """While one idle instance is being warmed, the next step warms another (the default
    allows several in flight): a hot prefix gains replicas at the rate of intervals, not
    of whole prefills of the prefix."""
    c, clock = conductor()
    rep = Replicator(c, RouterMetrics(c))
    hot(c, rep, "a")
    a = c.registry.get("a")
    assert a is not None and c.cfg.replication.max_inflight >= 2
    a.enqueue("busy", 2.0, clock[0])
    (first,) = rep.candidates(clock[0])
    rep.inflight.add(first.target.name)  # its warm-up is in flight (_start)
    (second,) = rep.candidates(clock[0])
    assert {first.target.name, second.target.name} == {"b", "c"}


def test_the_app_warms_an_idle_instance_with_a_hot_prefix(tiny_dir: str,
                                                         tokenizer: PromptTokenizer) -> None:
    """Requests of one shared prefix keep ``a`` busy (slow upstream); the replicator sends
    ``b`` the prefix with max_tokens=1; later requests use both."""
    ups = Upstreams(delay_s=0.3)
    cfg = make_cfg(tiny_dir, TWO, replication={"enabled": True, "min_heat": 2,
                                               "interval_s": 0.05})
    system = [int(t) for t in toks(9, 3 * BS)]

    async def go(client: httpx.AsyncClient) -> dict[str, Any]:
        async def one(i: int) -> httpx.Response:
            prompt = system + [int(t) for t in toks(200 + i, 40)]
            return await client.post("/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 2})
        first = await one(0)  # lands somewhere; its instance holds the prefix from now on
        assert first.status_code == 200
        rs = await asyncio.gather(*(one(i) for i in range(1, 9)))
        assert all(r.status_code == 200 for r in rs)
        await asyncio.sleep(0.3)
        metrics = (await client.get("/metrics")).text
        return {"first": first.headers["x-kvc-prefill"], "metrics": metrics}

    # 40 uncached tokens: 41 ms predicted; the whole prompt elsewhere: 0.8 s. All nine go
    # to the holder, whose queue grows past what b would take once it holds the prefix
    out = run(cfg, tokenizer, ups, go, profile=Profile(a=0.0, b=1e-3, c=0.001))
    warms = [(h, b) for h, _, b in ups.calls if b.get("max_tokens") == 1
             and b.get("prompt") == system]
    assert warms, ups.calls
    assert {h for h, _ in warms} == {"a", "b"} - {out["first"]}
    assert 'kvc_router_warmups_total{result="ok"}' in out["metrics"]


def test_replication_config_is_checked() -> None:
    for bad in ({"enabled": "maybe"}, {"min_gain": -1}, {"max_inflight": 0},
                {"interval_s": 0}, {"bogus": 1}):
        with pytest.raises(ValueError, match="(?i)replication"):
            RouterConfig.from_dict({"model": "m", "tokenizer": "x", "replication": bad})


def _warm_targets(specs: dict[str, dict[str, Any]]) -> list[str]:
    """The instances replication would warm with a hot prefix held by a busy ``a``, b and
    c being of ``specs``."""
    c, clock = conductor(specs=specs)
    rep = Replicator(c, RouterMetrics(c))
    hot(c, rep, "a")
    a = c.registry.get("a")
    assert a is not None
    a.enqueue("busy", 2.0, clock[0])
    return [w.target.name for w in rep.candidates(clock[0])]


def test_replication_is_on_by_default_and_never_warms_an_sglang_prefill_server() -> None:
    assert RouterConfig.from_dict({"model": "m", "tokenizer": "x"}).replication.enabled
    # b and c are idle but take no plain prefill
    assert _warm_targets({"b": {"kind": "sglang", "role": "prefill"},
                          "c": {"kind": "sglang", "role": "prefill"}}) == []
    # an SGLang server of both roles is warmed
    assert _warm_targets({"b": {"kind": "sglang", "role": "both"},
                          "c": {"kind": "sglang", "role": "prefill"}}) == ["b"]
