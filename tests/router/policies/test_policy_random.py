"""``random``: a uniformly random candidate from the policy's own generator."""

from __future__ import annotations

import random
from collections import Counter

from kvcentric.router.cost.decision import Decision, Rejection
from kvcentric.router.policies import make_policy
from tests.helpers.policies import fleet, route


def picks(seed: int, n: int = 200) -> list[tuple[str, str]]:
    pol = make_policy("random", random.Random(seed))
    pre, dec = fleet(2, "prefill"), fleet(2, "decode", first_slot=2, prefix="d")
    both = fleet(2, first_slot=4, prefix="b")
    out = []
    for _ in range(n):
        d = pol.choose(route([*pre, *both], [*dec, *both], runs={0: 32}))
        assert isinstance(d, Decision)
        out.append((d.prefill.name, d.decode.name))
    return out


def test_a_seeded_policy_repeats_its_choices() -> None:
    assert picks(7) == picks(7)
    assert picks(7) != picks(8)


def test_every_candidate_is_drawn_whatever_it_holds() -> None:
    got = picks(1, 400)
    by_prefill = Counter(p for p, _ in got)
    assert set(by_prefill) == {"i0", "i1", "b0", "b1"}
    assert min(by_prefill.values()) > 50  # i0's full prefix hit draws it no more often
    # a prefill-only instance hands over to a decoder, a both instance decodes itself
    assert all(d.startswith("d") for p, d in got if p.startswith("i"))
    assert all(p == d for p, d in got if p.startswith("b"))
    assert {d for p, d in got if p.startswith("i")} == {"d0", "d1"}


def test_no_candidate_is_a_refusal() -> None:
    r = make_policy("random", random.Random(0)).choose(route([], []))
    assert isinstance(r, Rejection) and r.reason == "no_instance"
