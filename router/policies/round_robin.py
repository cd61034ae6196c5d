"""``round_robin``: the next candidate in turn, blind to caches and load (a baseline)."""

from __future__ import annotations

import random

from kvcentric.router.cost.decision import Decision, Rejection
from kvcentric.router.fleet.instances import Instance
from kvcentric.router.policies.base import RouteInput, pair_with, servable


class RoundRobin:
    """Prefill candidates in turn, and decoders in turn on their own counter. The turn is
    a position in the candidate list, so an instance leaving rotation shifts it by one."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._next = 0
        self._next_decode = 0

    def choose(self, inp: RouteInput) -> Decision | Rejection:
        cands = servable(inp)
        if isinstance(cands, Rejection):
            return cands
        p = cands[self._next % len(cands)]
        self._next += 1
        return pair_with(inp, p, self._decoder)

    def _decoder(self, decoders: list[Instance]) -> Instance:
        d = decoders[self._next_decode % len(decoders)]
        self._next_decode += 1
        return d
