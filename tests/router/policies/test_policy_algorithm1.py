"""``algorithm1``: the policy is :func:`kvcentric.router.cost.decision.choose`, unchanged (its
maths is pinned by tests/router/test_router_decision.py)."""

from __future__ import annotations

import dataclasses

from kvcentric.router.config import SloConfig
from kvcentric.router.cost.decision import Decision, Landing, Rejection, choose
from kvcentric.router.policies import RouteInput, make_policy
from tests.helpers.policies import fleet, route


def direct(inp: RouteInput) -> Decision | Rejection:
    return choose(inp.prefill, inp.decode, inp.runs, inp.global_run, inp.n_tokens,
                  inp.params, inp.slo, inp.now, inp.global_tail, inp.disk_only,
                  inp.affinity, inp.landing)


def test_the_policy_returns_exactly_what_choose_does() -> None:
    pol = make_policy("algorithm1")
    pre, dec = fleet(3, "prefill"), fleet(2, "decode", first_slot=3, prefix="d")
    both = fleet(2, first_slot=5, prefix="b")
    pre[1].enqueue("q", 0.4, now=0.0)
    dec[0].decodes = 5
    cases = [route([*pre, *both], [*dec, *both], runs={0: 4, 1: 30, 5: 12}),
             route([*pre, *both], [*dec, *both], runs={6: 31}, global_run=20,
                   global_tail=True, disk_only=(18, 19, 20)),
             route(pre, dec, runs={}, affinity=b"\x01" * 16),
             route(both, both, runs={5: 2}, now=0.3),
             route(both, both, runs={5: 30}, global_run=2,
                   landing=Landing(30, 0.05, ("first",)))]
    for inp in cases:
        got, want = pol.choose(inp), direct(inp)
        assert type(got) is type(want) and isinstance(got, Decision)
        assert isinstance(want, Decision)
        assert (got.prefill, got.decode) == (want.prefill, want.decode)
        assert dataclasses.replace(got, prefill=want.prefill, decode=want.decode) == want


def test_it_prefers_the_instance_holding_the_prefix() -> None:
    fl = fleet(2)
    d = make_policy("algorithm1").choose(route(fl, runs={1: 30}))
    assert isinstance(d, Decision) and d.prefill is fl[1] and d.local_blocks == 30


def test_it_refuses_what_queueing_makes_late() -> None:
    fl = fleet(1)
    fl[0].enqueue("q", 5.0, now=0.0)
    slo = SloConfig(ttft_ms=1000, tbt_ms=100)
    r = make_policy("algorithm1").choose(route(fl, slo=slo))
    assert isinstance(r, Rejection) and r.reason == "ttft" and r.retry_after_s >= 1
    served = make_policy("algorithm1").choose(route(fl, slo=dataclasses.replace(
        slo, reject=False)))
    assert isinstance(served, Decision) and served.over_slo
