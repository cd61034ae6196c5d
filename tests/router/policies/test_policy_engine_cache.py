"""``engine_cache``: longest prefix in an engine's own cache, the store ignored."""

from __future__ import annotations

from kvcentric.router.cost.decision import Decision, Rejection
from kvcentric.router.policies import make_policy
from tests.helpers.policies import fleet, route


def chosen(fl: list, **kw: object) -> str:
    d = make_policy("engine_cache").choose(route(fl, **kw))  # type: ignore[arg-type]
    assert isinstance(d, Decision)
    return d.prefill.name


def test_the_longest_engine_prefix_wins_over_a_queue() -> None:
    fl = fleet(3)
    fl[2].enqueue("a", 0.5, now=0.0)  # within half the 2 s SLO of the others
    assert chosen(fl, runs={0: 10, 1: 20, 2: 30}) == "i2"


def test_equal_prefixes_go_to_the_less_loaded() -> None:
    fl = fleet(2)
    fl[0].enqueue("a", 0.3, now=0.0)
    assert chosen(fl, runs={0: 30, 1: 30}) == "i1"


def test_a_match_under_half_the_prompt_goes_to_the_least_loaded() -> None:
    fl = fleet(3)
    fl[0].enqueue("a", 0.3, now=0.0)
    fl[1].enqueue("b", 0.2, now=0.0)
    assert chosen(fl, runs={0: 15}) == "i2"  # 15 of 32 blocks
    assert chosen(fl, runs={0: 16}) == "i0"  # half: the hit counts


def test_an_imbalanced_fleet_goes_to_the_least_loaded() -> None:
    fl = fleet(2)
    fl[0].enqueue("a", 1.5, now=0.0)  # more than half the 2 s SLO ahead of i1
    assert chosen(fl, runs={0: 32}) == "i1"


def test_the_store_tier_is_not_looked_at() -> None:
    fl = fleet(2)
    fl[0].enqueue("a", 0.3, now=0.0)
    # the whole prompt in the store changes nothing: blocks in no engine are no hit
    assert chosen(fl, runs={}, global_run=32) == chosen(fl, runs={}) == "i1"


def test_no_candidate_is_a_refusal() -> None:
    r = make_policy("engine_cache").choose(route([], []))
    assert isinstance(r, Rejection) and r.reason == "no_instance"
