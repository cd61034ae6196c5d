"""Routing policies: the Conductor's extension point (docs/architecture.md §Module map).

A policy implements :class:`~.base.RoutingPolicy` (``choose(RouteInput) -> Decision |
Rejection``) and is registered under a name in :data:`POLICIES`; the router config's
``policy:`` key picks one (default ``algorithm1``), and the simulator
(:mod:`benchmarks.sim.cluster`) runs the same objects. Modules:

- :mod:`.base`: ``RouteInput``, the ``RoutingPolicy`` protocol, the helpers baselines share;
- :mod:`.algorithm1`: Mooncake's Algorithm 1 (:func:`kvcentric.router.cost.decision.choose`);
- :mod:`.round_robin`, :mod:`.random_choice`, :mod:`.least_loaded`: blind baselines;
- :mod:`.engine_cache`: cache-aware on the engines' caches only, no store tier.

Adding one: a new module with a class whose constructor takes a ``random.Random`` and
whose ``choose`` returns a decision (``base.decision_for`` builds one for a chosen pair),
and one line in :data:`POLICIES`.
"""

from __future__ import annotations

import random

from kvcentric.router.policies.algorithm1 import Algorithm1
from kvcentric.router.policies.base import PolicyFactory, RouteInput, RoutingPolicy
from kvcentric.router.policies.engine_cache import EngineCache
from kvcentric.router.policies.least_loaded import LeastLoaded
from kvcentric.router.policies.random_choice import RandomChoice
from kvcentric.router.policies.round_robin import RoundRobin

__all__ = ["DEFAULT_POLICY", "POLICIES", "PolicyFactory", "RouteInput", "RoutingPolicy",
           "check_policy", "make_policy"]

DEFAULT_POLICY = "algorithm1"

# the registry: one line per policy (name in the router config's ``policy:`` -> factory)
POLICIES: dict[str, PolicyFactory] = {
    "algorithm1": Algorithm1,
    "round_robin": RoundRobin,
    "random": RandomChoice,
    "least_loaded": LeastLoaded,
    "engine_cache": EngineCache,
}


def check_policy(name: object) -> str:
    """``name`` if it is a registered policy, else ``ValueError`` listing the known ones."""
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"policy {name!r} is not a routing policy; known: "
                         f"{', '.join(sorted(POLICIES))}")
    return name


def make_policy(name: str, rng: random.Random | None = None) -> RoutingPolicy:
    """A fresh policy object of the registered ``name`` (``ValueError`` if unknown);
    ``rng``: its randomness (a fresh unseeded generator when None)."""
    return POLICIES[check_policy(name)](rng or random.Random())
