"""The seam itself: the ``policy:`` key picks a registered policy, and a new policy is one
class plus one registration line (issue 45 item 2)."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvcentric.hashing import block_hashes, hash_seed
from kvcentric.router import policies
from kvcentric.router.conductor import Conductor
from kvcentric.router.config import RouterConfig
from kvcentric.router.cost.cost_model import Profile
from kvcentric.router.cost.decision import Decision, Rejection
from kvcentric.router.fleet.instance_spec import InstanceSpec
from kvcentric.router.fleet.store_view import StoreView
from kvcentric.router.policies import RouteInput, make_policy
from kvcentric.router.policies.algorithm1 import Algorithm1
from kvcentric.router.policies.base import decision_for, servable

BS = 16


class LastNamed:
    """A toy policy: always the candidate whose name sorts last."""

    def __init__(self, rng: random.Random) -> None:
        self.calls = 0

    def choose(self, inp: RouteInput) -> Decision | Rejection:
        self.calls += 1
        cands = servable(inp)
        if isinstance(cands, Rejection):
            return cands
        p = max(cands, key=lambda i: i.name)
        return decision_for(inp, p, p)


def conductor(**raw: object) -> Conductor:
    cfg = RouterConfig.from_dict({"model": "m", "tokenizer": "x",
                                  "keys": {"block_size": BS}, **raw})
    c = Conductor(cfg, Profile(a=0.0, b=1e-3, c=0.01), 1024, StoreView(None, "m"))
    for n in ("e0", "e1", "e2"):
        c.registry.add(InstanceSpec(url=f"http://{n}:1", role="both", name=n))
    return c


def hashes(seed: int, blocks: int = 8) -> list[bytes]:
    return block_hashes([seed * 1000 + i for i in range(blocks * BS)], BS, hash_seed("m"))


def test_a_toy_policy_registered_in_one_line_is_selected_by_config(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(policies.POLICIES, "toy", LastNamed)  # the registration line
    c = conductor(policy="toy")
    assert isinstance(c.policy, LastNamed)
    h = hashes(1)
    c.index.add(c.registry.get("e0").slot, h)  # type: ignore[union-attr]
    for _ in range(3):  # Algorithm 1 would take e0, which holds the prefix
        d = asyncio.run(c.decide(h, len(h) * BS))
        assert isinstance(d, Decision) and d.prefill.name == "e2"
        c.dispatched(d, "r", h)
    assert c.policy.calls == 3
    c.registry.get("e2").healthy = False  # type: ignore[union-attr]
    d = c.decide_local(h, len(h) * BS, 0)
    assert isinstance(d, Decision) and d.prefill.name == "e1"


def test_the_default_is_algorithm1_and_a_baseline_is_one_key_away() -> None:
    assert RouterConfig.from_dict({"model": "m", "tokenizer": "x"}).policy == "algorithm1"
    assert isinstance(conductor().policy, Algorithm1)
    c = conductor(policy="round_robin")
    h = hashes(2)
    names = []
    for _ in range(3):
        d = c.decide_local(h, len(h) * BS, 0)
        assert isinstance(d, Decision)
        names.append(d.prefill.name)
    assert names == ["e0", "e1", "e2"]


def test_an_unknown_policy_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="policy 'fastest'.*algorithm1.*round_robin"):
        RouterConfig.from_dict({"model": "m", "tokenizer": "x", "policy": "fastest"})
    with pytest.raises(ValueError, match="known: algorithm1"):
        RouterConfig.from_dict({"model": "m", "tokenizer": "x", "policy": ["random"]})
    with pytest.raises(ValueError, match="known"):
        make_policy("fastest")


def test_every_registered_policy_routes_a_request() -> None:
    h = hashes(3)
    for name in policies.POLICIES:
        d = conductor(policy=name).decide_local(h, len(h) * BS, 0)
        assert isinstance(d, Decision), name
