"""``round_robin``: candidates in turn, blind to caches and load."""

from __future__ import annotations

from kvcentric.router.cost.decision import Decision, Rejection
from kvcentric.router.policies import make_policy
from tests.helpers.policies import PARAMS, N, fleet, route


def test_turns_go_through_every_candidate_whatever_it_holds_or_queues() -> None:
    pol = make_policy("round_robin")
    fl = fleet(3)
    fl[0].enqueue("busy", 5.0, now=0.0)  # a long queue does not skip i0's turn
    picked = []
    for _ in range(6):
        d = pol.choose(route(fl, runs={2: 32}))  # nor does i2's full prefix hit
        assert isinstance(d, Decision) and d.decode is d.prefill
        picked.append(d.prefill.name)
    assert picked == ["i0", "i1", "i2", "i0", "i1", "i2"]


def test_prefill_only_instances_hand_over_to_decoders_in_their_own_turn() -> None:
    pol = make_policy("round_robin")
    pre, dec = fleet(2, "prefill"), fleet(3, "decode", first_slot=2, prefix="d")
    pairs = []
    for _ in range(3):
        d = pol.choose(route(pre, dec))
        assert isinstance(d, Decision) and d.disaggregated
        pairs.append((d.prefill.name, d.decode.name))
    assert pairs == [("i0", "d0"), ("i1", "d1"), ("i0", "d2")]


def test_the_decision_carries_the_cost_models_prediction() -> None:
    d = make_policy("round_robin").choose(route(fleet(1), runs={0: 10}))
    assert isinstance(d, Decision)
    assert d.local_blocks == 10 and d.hit_tokens == 10 * 256
    assert d.prefill_s == PARAMS.profile.prefill_s(N, 10 * 256)
    assert [c.name for c in d.candidates] == ["i0"]


def test_refuses_only_when_nothing_can_serve() -> None:
    pol = make_policy("round_robin")
    none = pol.choose(route([], []))
    assert isinstance(none, Rejection) and none.reason == "no_instance"
    no_decoder = pol.choose(route(fleet(2, "prefill"), []))
    assert isinstance(no_decoder, Rejection) and no_decoder.reason == "no_instance"
    assert "decode" in no_decoder.message
