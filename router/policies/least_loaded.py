"""``least_loaded``: the candidate with the least queued prefill work, blind to caches.

Queued work is the router's prediction in seconds (``Instance.queue_s``: its own queue and
busy peers on its processor), the cost model's measure of outstanding prefill tokens;
ties go to fewer running sequences. Decoders: fewest running, then the emptier KV cache.
"""

from __future__ import annotations

import random

from kvcentric.router.cost.decision import Decision, Rejection
from kvcentric.router.policies.base import RouteInput, least_busy, pair_with, servable


class LeastLoaded:
    def __init__(self, rng: random.Random | None = None) -> None:
        """Deterministic: ``rng`` is unused (ties go to the first listed)."""

    def choose(self, inp: RouteInput) -> Decision | Rejection:
        cands = servable(inp)
        if isinstance(cands, Rejection):
            return cands
        now = inp.now
        p = min(cands, key=lambda i: (i.queue_s(now), i.batch()))
        return pair_with(inp, p, least_busy)
