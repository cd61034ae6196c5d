"""``random``: a uniformly random candidate, blind to caches and load (a baseline)."""

from __future__ import annotations

import random

from kvcentric.router.cost.decision import Decision, Rejection
from kvcentric.router.policies.base import RouteInput, pair_with, servable


class RandomChoice:
    """Prefill candidate and decoder drawn from ``rng`` (seeded for a reproducible run)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, inp: RouteInput) -> Decision | Rejection:
        cands = servable(inp)
        if isinstance(cands, Rejection):
            return cands
        p = cands[self.rng.randrange(len(cands))]
        return pair_with(inp, p, lambda ds: ds[self.rng.randrange(len(ds))])
