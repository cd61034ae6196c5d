"""``algorithm1`` (the default): Mooncake's Algorithm 1 (:mod:`kvcentric.router.cost.decision`).

The lowest predicted TTFT over every tier (engine cache, store DRAM and disk), ties broken
by load, and refusals of what would miss the SLO; the maths stays in
:mod:`kvcentric.router.cost.decision`, which its own tests pin.
"""

from __future__ import annotations

import random

from kvcentric.router.cost.decision import Decision, Rejection, choose
from kvcentric.router.policies.base import RouteInput


class Algorithm1:
    def __init__(self, rng: random.Random | None = None) -> None:
        """Deterministic: ``rng`` is unused (ties go by load, then rendezvous rank)."""

    def choose(self, inp: RouteInput) -> Decision | Rejection:
        return choose(inp.prefill, inp.decode, inp.runs, inp.global_run, inp.n_tokens,
                      inp.params, inp.slo, inp.now, inp.global_tail, inp.disk_only,
                      inp.affinity, inp.landing)
