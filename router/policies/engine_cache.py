"""``engine_cache``: cache-aware on the engines' own caches only (SGLang router style).

The store tier is ignored: the instance with the longest leading run of the prompt in its
engine cache wins (ties: the less loaded), unless that run is under half the prompt's full
blocks, or the fleet is imbalanced (the most and least queued instances differ by more
than half the TTFT SLO): then the least loaded instance. Load is queued prefill work
(``Instance.queue_s``). Never refuses for SLOs. Decoders: fewest running.
"""

from __future__ import annotations

import random

from kvcentric.router.cost.decision import Decision, Rejection
from kvcentric.router.policies.base import RouteInput, least_busy, pair_with, servable

CACHE_THRESHOLD = 0.5  # share of the prompt's blocks a match must cover to win (SGLang's)


class EngineCache:
    def __init__(self, rng: random.Random | None = None) -> None:
        """Deterministic: ``rng`` is unused (ties go to the first listed)."""

    def choose(self, inp: RouteInput) -> Decision | Rejection:
        cands = servable(inp)
        if isinstance(cands, Rejection):
            return cands
        loads = [p.queue_s(inp.now) for p in cands]
        order = range(len(cands))
        least = min(order, key=loads.__getitem__)
        pick = least
        # half the SLO of queueing apart: balancing matters more than a cache hit
        if max(loads) - loads[least] <= inp.slo.ttft_ms / 2000.0:
            runs = [inp.runs.get(p.slot, 0) for p in cands]
            best = max(order, key=lambda i: (runs[i], -loads[i]))
            blocks = inp.n_tokens // inp.params.block_size
            if blocks and runs[best] >= CACHE_THRESHOLD * blocks:
                pick = best
        return pair_with(inp, cands[pick], least_busy)
