"""Hand-built fleets for the routing policies' tests (tests/router/policies/)."""

from __future__ import annotations

from typing import Any

from kvcentric.router.config import SloConfig
from kvcentric.router.cost.cost_model import Profile
from kvcentric.router.cost.decision import CostParams
from kvcentric.router.fleet.instance_spec import InstanceSpec
from kvcentric.router.fleet.instances import Instance
from kvcentric.router.policies import RouteInput

BS = 256
PROFILE = Profile(a=1e-9, b=1e-4, c=0.005, tbt_base_s=0.02, tbt_per_seq_s=0.002)
PARAMS = CostParams(PROFILE, BS, 4096 * BS, 1e9)  # a block loads in ~1 ms
SLO = SloConfig(ttft_ms=2000, tbt_ms=100)
N = 32 * BS + 10  # 32 full blocks and a tail


def inst(name: str, slot: int, role: str = "both") -> Instance:
    return Instance(InstanceSpec(url=f"http://{name}:1", role=role, name=name), slot)


def route(prefill: list[Instance], decode: list[Instance] | None = None,
          runs: dict[int, int] | None = None, **kw: Any) -> RouteInput:
    """A request of ``N`` tokens at time 0 over ``prefill`` (and ``decode``, by default
    the same instances) with the engine-cache ``runs`` given."""
    args: dict[str, Any] = {"global_run": 0, "n_tokens": N, "params": PARAMS, "slo": SLO,
                            "now": 0.0} | kw
    return RouteInput(prefill, prefill if decode is None else decode, runs or {}, **args)



def fleet(n: int, role: str = "both", first_slot: int = 0, prefix: str = "i"
          ) -> list[Instance]:
    """``n`` instances named ``{prefix}0``, ``{prefix}1``, ... on consecutive slots."""
    return [inst(f"{prefix}{k}", first_slot + k, role) for k in range(n)]
