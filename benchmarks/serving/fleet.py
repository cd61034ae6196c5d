"""vLLM CPU instances for comparisons: started per arm (or once for all), warmed up,
reset between arms, and stopped (only the processes started here)."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcentric.config import StoreConfig
from kvcentric.store import open_store
from kvcentric.store.local import launcher
from kvcentric.testing.servers import VllmServer

SERVED_NAME = "bench"
CPU_PAGE = 128  # vLLM CPU's KV page (block) size in tokens
SERVER_ARGS = ("--enable-prompt-tokens-details",)  # per-request cached-token counts


@dataclass(frozen=True)
class Arm:
    """One side of a comparison.

    ``kv_transfer``: the instances' connector (None: no connector); ``store``: a local
    store the arm owns (stopped afterwards); ``gateway``: what sits in front of the
    instances (``"client-rr"``: none, the client round-robins; ``"sglang:<policy>"``,
    ``"smg:<policy>"``, ``"vllm-router:<policy>"``: a peer router, see
    :mod:`benchmarks.serving.gateways`; ``"kvcentric"``: our router, with
    ``gateway_opts`` for its config). ``retry_429``: the arm's clients resend a refused
    request after its ``Retry-After``, up to this many times (TTFT counts the waits).
    ``shared_store`` False (emulated fleets only, :mod:`.fleet_runs`): for this arm the
    engines keep KV in their own caches only, and our router is told of no store (the
    Mooncake paper's Figure 5 baselines, which have no global pool).
    ``sync_decode_loads`` (emulated P/D fleets): the decode-only instances load each
    request's KV inside their steps (the connector's ``async_loads: false``) instead of
    beside them (its default for a ``kv_consumer``): an ablation.
    """

    name: str
    kv_transfer: dict[str, Any] | None = None
    store: dict[str, Any] | None = None
    gateway: str = "client-rr"
    gateway_opts: dict[str, Any] = field(default_factory=dict)
    retry_429: int = 0
    shared_store: bool = True
    sync_decode_loads: bool = False


@dataclass(frozen=True)
class FleetSpec:
    """What every instance of every arm shares; ``instance_env[i]`` is added to ``env``
    for instance ``i`` (e.g. its own cores)."""

    model: str
    instances: int = 2
    dtype: str = "bfloat16"
    max_model_len: int = 4096
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = SERVER_ARGS
    instance_env: tuple[dict[str, str], ...] = ()

    def env_of(self, i: int) -> dict[str, str]:
        return {**self.env, **(self.instance_env[i] if i < len(self.instance_env) else {})}


def pinned_threads_env() -> dict[str, str]:
    """Same worker threads with and without a connector (see FIELD-NOTES, fairness trap)."""
    return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1" if (os.cpu_count() or 1) <= 2 else "0"}


def own_cores_env(instances: int, cpus: Collection[int] | None = None
                  ) -> tuple[dict[str, str], ...] | None:
    """Per instance, worker threads bound to cores of its own (an equal share of ``cpus``,
    default this process's affinity, but the lowest, which stays for the API servers, the
    router, the store and the client): separate processors, as engines on separate GPUs
    are. None when there are not enough cores for that (fewer than ``instances + 1``):
    vLLM's automatic binding then puts every instance's worker on the same cores and
    leaves the rest to the host side. Measured on 2 cores: one engine per core starved
    those processes (TTFT spikes whenever both engines ran), so a router that used one
    engine looked best. ValueError when ``instances`` < 1."""
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else set(cpus))
    spare = cpus[1:]
    if len(spare) < instances:
        return None
    per = len(spare) // instances
    return tuple({"VLLM_CPU_OMP_THREADS_BIND": ",".join(
        str(c) for c in spare[i * per:(i + 1) * per])} for i in range(instances))


def engine_cache_args(tokens: int) -> tuple[str, ...]:
    """Server flags limiting the engine's own KV cache to ``tokens`` (0: vLLM's default)."""
    return ("--num-gpu-blocks-override", str(tokens // CPU_PAGE)) if tokens else ()


def engine_cache_text(tokens: int) -> str:
    return f"{tokens} tokens per instance" if tokens else "vLLM's default (1 GiB per instance)"


def warm_up(servers: Sequence[VllmServer], seed: str) -> None:
    """One unrelated request per instance: first requests pay one-off costs."""
    rnd = random.Random(f"warmup/{seed}")
    for s in servers:
        s.complete([rnd.randrange(4, 4000) for _ in range(300)], max_tokens=2, timeout_s=600)


@contextlib.contextmanager
def fleet(spec: FleetSpec, arm: Arm, logs: Path) -> Iterator[list[VllmServer]]:
    """Start ``spec.instances`` servers for ``arm``, warm each up, stop them on exit."""
    if not arm.shared_store:
        raise ValueError(f"arm {arm.name}: shared_store=False is for emulated fleets; a "
                         "vLLM arm without a store has no kv_transfer")
    servers = [VllmServer(spec.model, SERVED_NAME, arm.kv_transfer, spec.dtype,
                          spec.max_model_len, spec.args, spec.env_of(i),
                          logs / f"{arm.name}-{i}.log") for i in range(spec.instances)]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(900)
        warm_up(servers, arm.name)
        yield servers
    finally:
        for s in servers:
            s.stop()
        if arm.store is not None:
            launcher.stop(StoreConfig.from_dict(arm.store))


def reset_caches(servers: Sequence[VllmServer], store: dict[str, Any] | None) -> None:
    """Empty every instance's prefix cache and the store, so the next arm starts cold."""
    for s in servers:
        s.reset_prefix_cache()
    if store is not None:
        with open_store(store) as st:
            clear = getattr(st, "clear", None)
            if clear is None:
                raise ValueError("the store backend cannot be cleared between arms")
            clear()
