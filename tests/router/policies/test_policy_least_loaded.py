"""``least_loaded``: the least queued prefill work, blind to caches."""

from __future__ import annotations

from kvcentric.router.cost.decision import Decision, Rejection
from kvcentric.router.policies import make_policy
from tests.helpers.policies import fleet, route


def test_the_shortest_queue_wins_over_a_prefix_hit() -> None:
    fl = fleet(3)
    fl[0].enqueue("a", 0.5, now=0.0)
    fl[1].enqueue("b", 0.2, now=0.0)
    fl[2].enqueue("c", 0.9, now=0.0)
    d = make_policy("least_loaded").choose(route(fl, runs={0: 32, 2: 32}))
    assert isinstance(d, Decision) and d.prefill is fl[1] and d.decode is fl[1]


def test_queues_drain_with_time_and_ties_go_to_fewer_running() -> None:
    fl = fleet(2)
    fl[0].enqueue("a", 0.5, now=0.0)
    fl[1].decodes = 3
    pol = make_policy("least_loaded")
    early = pol.choose(route(fl, now=0.1))
    assert isinstance(early, Decision) and early.prefill is fl[1]
    late = pol.choose(route(fl, now=1.0))  # i0's work is done: a tie, i0 runs nothing
    assert isinstance(late, Decision) and late.prefill is fl[0]


def test_the_handover_goes_to_the_decoder_running_fewest() -> None:
    pre, dec = fleet(1, "prefill"), fleet(3, "decode", first_slot=1, prefix="d")
    dec[0].decodes, dec[1].decodes, dec[2].decodes = 4, 1, 1
    dec[1].stats.kv_usage = 0.5
    d = make_policy("least_loaded").choose(route(pre, dec))
    assert isinstance(d, Decision) and d.decode is dec[2] and d.disaggregated


def test_no_candidate_is_a_refusal() -> None:
    r = make_policy("least_loaded").choose(route([], []))
    assert isinstance(r, Rejection) and r.reason == "no_instance"
