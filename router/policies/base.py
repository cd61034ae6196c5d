"""The routing-policy seam: what every policy is given, what it returns, shared helpers.

A policy sees one request's :class:`RouteInput` (its prefix view per instance and tier,
the fleet's queue state, the SLOs) and returns a :class:`~kvcentric.router.cost.decision.Decision`
(the chosen prefill/decode pair) or a :class:`~kvcentric.router.cost.decision.Rejection`. It
never does I/O and never reads a clock (``now`` is in the input), so the Conductor, the
simulator (:mod:`benchmarks.sim.cluster`) and the tests call the same code. A policy may
keep state of its own (a round-robin counter, a random generator): one object serves one
router (or one simulated run) for its lifetime, on one thread.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvcentric.router.config import SloConfig
from kvcentric.router.cost.decision import (
    CostParams,
    Decision,
    Landing,
    Rejection,
    decode_cost,
    hit_tokens,
    prefill_cost,
)
from kvcentric.router.fleet.instances import Instance


@dataclass(frozen=True, slots=True)
class RouteInput:
    """One request as a policy sees it.

    ``prefill``/``decode``: the healthy candidates that can prefill (or decode), with their
    queue state (``Instance.queue_s``, ``batch()``, ``stats.kv_usage``). Prefix view per
    tier: ``runs`` maps an instance's slot to the leading run of the prompt's full blocks
    in its engine cache; ``global_run`` is the run in the store, ``global_tail`` whether
    the store also holds the prompt's tail after it, ``disk_only`` the ascending positions
    of that run held only on the store's disk tier. ``n_tokens``: the prompt's length;
    ``params``: cost model and block size; ``slo``: the service levels; ``now``: the
    clock; ``affinity``: the prompt's first block hash (b"" when it has none);
    ``landing``: blocks after the stored run that in-flight prefills will store (a policy
    that waits for them returns a decision that ``awaits`` it; others ignore it)."""

    prefill: Sequence[Instance]
    decode: Sequence[Instance]
    runs: dict[int, int]
    global_run: int
    n_tokens: int
    params: CostParams
    slo: SloConfig
    now: float
    global_tail: bool = False
    disk_only: Sequence[int] = ()
    affinity: bytes = b""
    landing: Landing | None = None


class RoutingPolicy(Protocol):
    """Picks the (prefill, decode) pair for one request, or refuses it."""

    def choose(self, inp: RouteInput) -> Decision | Rejection:
        """The pair for ``inp`` (a ``both`` instance decodes what it prefilled, a
        ``prefill`` one hands over to a ``decode`` one), or a refusal: ``no_instance``
        when nothing can serve it; ``ttft``/``tbt`` only from SLO-aware policies."""
        ...


# a factory: the registry's entries; ``rng`` is the only randomness a policy may use
PolicyFactory = Callable[[random.Random], RoutingPolicy]


def servable(inp: RouteInput) -> list[Instance] | Rejection:
    """The prefill candidates a blind policy may pick: all of them when some decode-role
    instance can take the handover, else the ``both`` ones; a ``no_instance`` refusal
    when none is left."""
    if any(d.spec.role == "decode" for d in inp.decode):
        cands = list(inp.prefill)
    else:
        cands = [p for p in inp.prefill if p.spec.role == "both"]
    if cands:
        return cands
    why = ("no healthy instance that can prefill" if not inp.prefill else
           "no healthy decode instance for the prefill-only instances")
    return Rejection("no_instance", 1, math.inf, math.inf, why)


def decoders(inp: RouteInput) -> list[Instance]:
    """The decode-role candidates (a ``both`` instance decodes only its own prefills)."""
    return [d for d in inp.decode if d.spec.role == "decode"]


def least_busy(instances: Sequence[Instance]) -> Instance:
    """Fewest running sequences (the router's own count or the engine's gauge), then the
    emptier KV cache, then the first listed."""
    return min(instances, key=lambda d: (d.batch(), d.stats.kv_usage))


def decision_for(inp: RouteInput, p: Instance, d: Instance) -> Decision:
    """The :class:`Decision` for a pair a policy chose, with the cost model's predictions
    (the Conductor queues ``prefill_s`` on ``p`` and learns its correction from them;
    ``d is p`` for a ``both`` instance). Never refuses: policies that honour the SLOs
    decide that themselves."""
    params, runs = inp.params, inp.runs
    pc = prefill_cost(p, runs.get(p.slot, 0), inp.global_run, inp.n_tokens, params,
                      inp.now, inp.global_tail, inp.disk_only)
    ttft = pc.ttft_s
    if d is p:
        tbt = params.profile.tbt_s(p.batch() + 1, p.stats.kv_usage)
    else:
        dc = decode_cost(d, runs.get(d.slot, 0), inp.n_tokens // params.block_size,
                         inp.n_tokens, params, inp.disk_only)
        ttft += dc.load_s + dc.tbt_s
        tbt = dc.tbt_s
    hit = hit_tokens(pc.local_blocks, inp.global_run, inp.global_tail, inp.n_tokens,
                     params.block_size)
    replicated = pc.local_blocks < inp.global_run and any(
        runs.get(o.slot, 0) > pc.local_blocks for o in inp.prefill if o is not p)
    return Decision(p, d, ttft, tbt, pc.prefill_s, hit, pc.local_blocks,
                    max(0, inp.global_run - pc.local_blocks), replicated, (pc,),
                    over_slo=ttft > inp.slo.ttft_ms / 1000.0, load_on_disk=pc.load_on_disk,
                    load_s=pc.load_s)


def pair_with(inp: RouteInput, p: Instance,
              pick: Callable[[list[Instance]], Instance]) -> Decision:
    """``p`` with itself (a ``both`` instance) or with the decoder ``pick`` takes from the
    decode-role candidates (:func:`servable` made sure there is one)."""
    return decision_for(inp, p, p if p.spec.role == "both" else pick(decoders(inp)))
