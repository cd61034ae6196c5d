"""Arms over one emulated fleet, each run from empty caches, with what each run measured.

Start the fleet with a store, fit our router's profile on it, run every arm (a router in
front, or the client round-robin) with caches emptied before each, repeat with the arms'
order rotated, and keep what each run measured.

On a small machine the emulated engines and everything in front of them share the CPUs:
:func:`split_cpus` gives the emulator a CPU of its own and the routers, the client and
the store the rest (a router's tokenising threads would otherwise slow the emulated
engines, which stand for GPUs the router never competes with).

Used by :mod:`benchmarks.serving.fleet_compare` (and :mod:`.fleet_replicas`). The fleet
is :mod:`benchmarks.emulator` engines in one process, every one publishing vLLM's KV
events with a replay endpoint; our router is told those endpoints (its residency comes
from the engines' events), the peers route on request text as they do on real vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.emulator.launch import EmulatedFleet, EmulatorSpec
from benchmarks.emulator.profile import load as load_profile
from benchmarks.lib.procfs import group_cpu_seconds
from benchmarks.serving.fleet import Arm
from benchmarks.serving.gateways import Gateway, gateway_for
from kvcentric.bench_serving.client import Api
from kvcentric.bench_serving.loadgen import benchmark
from kvcentric.bench_serving.runner import RunConfig
from kvcentric.bench_serving.tokens import TokenSource
from kvcentric.bench_serving.workloads import Workload
from kvcentric.config import StoreConfig
from kvcentric.store import open_store
from kvcentric.store.local import launcher


@dataclass(frozen=True)
class FleetSetup:
    """What every arm of a run shares: the emulated fleet, roles, SLO, endpoint."""

    emulator: EmulatorSpec
    slo_ttft_ms: float
    slo_tpot_ms: float
    endpoint: str = "completions"
    roles: tuple[str, ...] = ()  # per instance (default: all "both")
    store_capacity: str = "4gb"
    use_store: bool = True  # False: engines keep only their own prefix caches
    router_cpus: tuple[int, ...] | None = None  # routers (and peers) run on these CPUs
    router_extra: dict[str, Any] = field(default_factory=dict)

    def role(self, i: int) -> str:
        return self.roles[i] if i < len(self.roles) else "both"

    def our_sections(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Config sections for our router over its defaults: the engines' context, then
        :attr:`router_extra`, then ``extra``. The context is the emulator's, not the
        tokenizer's ``config.json`` (the bench model names 32k; the H100 profile's
        Llama-3.1-8B serves 128k): else the router alone refuses prompts that the
        engines serve behind the peers' routers."""
        return {"limits": {"max_model_len": self.emulator.max_model_len},
                **self.router_extra, **(extra or {})}

    @property
    def dilation(self) -> float:
        """Wall seconds per emulated second: SLOs given to the client and the routers
        are multiplied by it, measured times divided (:func:`summary_row`)."""
        return self.emulator.dilation


def split_cpus() -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(emulator CPUs, everyone else's): the last CPU for the emulator, the others for
    the rest; (None, None) on a 1-CPU machine."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return (cpus[-1],), tuple(cpus[:-1])


def router_profile(url: str, model: str, model_dir: str, page: int, out: Path) -> str:
    """Our router's cost profile, fitted by its own ``profile`` command on one instance."""
    subprocess.run([sys.executable, "-m", "kvcentric.router.cli", "profile", "--url", url,
                    "--model", model, "--out", str(out), "--lengths", "256,1024,2048",
                    "--repeats", "1", "--page", str(page), "--model-dir", model_dir,
                    "--kv-dtype", "bfloat16", "--store-tokens", "1024"],
                   check=True, timeout=900, capture_output=True)
    return str(out)


class FleetRun:
    """One emulated fleet (and its store) for a sequence of arm runs."""

    def __init__(self, setup: FleetSetup, logs: Path) -> None:
        self.setup = setup
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.store: dict[str, Any] | None = (
            {"name": f"fl{uuid.uuid4().hex[:8]}", "capacity": setup.store_capacity}
            if setup.use_store else None)
        self.fleet = EmulatedFleet(replace(setup.emulator, store=self.store), logs)
        self.profile: str | None = None
        self.runs = 0  # arm runs so far: each tags its requests apart from the earlier ones

    def __enter__(self) -> FleetRun:
        if self.store is not None:
            launcher.ensure_running(StoreConfig.from_dict({**self.store, "prefault": False}))
        self.fleet.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.fleet.stop()
        if self.store is not None:
            launcher.stop(StoreConfig.from_dict(self.store))

    @property
    def instances(self) -> list[dict[str, Any]]:
        """Our router's instance entries: URL, role, the engine's event endpoints."""
        return [{"url": s["url"], "name": s["name"], "role": self.setup.role(i),
                 **({"kv_events": s["kv_events"], "kv_events_replay": s["kv_events_replay"]}
                    if "kv_events" in s else {})}
                for i, s in enumerate(self.fleet.specs)]

    def reset(self) -> None:
        """Empty every engine's prefix cache and the store."""
        self.fleet.reset()
        if self.store is not None:
            with open_store(self.store) as st:
                st.clear()  # type: ignore[attr-defined]

    def router_profile(self) -> str:
        if self.profile is None:
            e = self.setup.emulator
            page = load_profile(e.profile).page_size
            self.profile = router_profile(self.fleet.urls[0], e.model, e.tokenizer, page,
                                          self.logs / "router-profile.json")
            self.reset()
        return self.profile

    def gateway(self, arm: Arm, tag: str = "",
                extra: dict[str, Any] | None = None) -> Gateway | None:
        """``arm``'s router over the fleet; ``extra``: config sections for ours, over
        the setup's ``router_extra`` and the arm's own (``gateway_opts["extra"]``)."""
        s = self.setup
        kw: dict[str, Any] = {}
        if arm.gateway == "kvcentric":
            opts = dict(arm.gateway_opts)
            sections = {**opts.pop("extra", {}), **(extra or {})}  # the arm's, then the call's
            kw = {"model": s.emulator.model,
                  "store": self.store if arm.shared_store else None,
                  "slo_ttft_ms": s.slo_ttft_ms * s.dilation,
                  "slo_tpot_ms": s.slo_tpot_ms * s.dilation,
                  "profile": self.router_profile(), "dtype": "bfloat16",
                  "instances": self.instances, "extra": s.our_sections(sections),
                  "tag": tag, **opts}
        gw = gateway_for(arm.gateway, self.fleet.urls, self.logs,
                         tokenizer=s.emulator.tokenizer, **kw)
        if gw is not None:
            gw.cpus = s.router_cpus
        return gw

    def run_arm(self, arm: Arm, workload: Workload, src: TokenSource, rep: int,
                gateways: Callable[[Arm], list[Gateway]] | None = None,
                during: Callable[[list[Gateway], threading.Event], dict[str, Any]] | None
                = None) -> dict[str, Any]:
        """Reset, start the arm's router(s), run the workload once, stop; the result
        with the engines' own account (busy time, event-loop lag, per-request hits).
        Several routers (``gateways``) are served round-robin by the client, which moves
        a request whose connection is refused to the next one (a load balancer's
        failover); ``during(gateways, done)`` runs on a thread alongside the workload
        (``done`` is set when the workload ends; its result is ``res["during"]``)."""
        s = self.setup
        self.reset()
        if self.store is not None:
            self.fleet.use_store(arm.shared_store)
        # as the connector loads: beside the steps on a P/D decode instance (kv_consumer)
        self.fleet.async_loads([s.role(i) == "decode" and not arm.sync_decode_loads
                                for i in range(len(self.fleet.urls))])
        gws = gateways(arm) if gateways else [g for g in [self.gateway(arm)] if g]
        side: dict[str, Any] = {}
        try:
            for g in gws:
                g.start()
            for g in gws:
                g.wait_ready(180)
            base = [g.url for g in gws] or self.fleet.urls
            # the engines keep every request they finished for the fleet's whole life: a
            # tag per run (not per arm and repetition) keeps a run's records its own
            self.runs += 1
            tag = f"{arm.name}.{rep}.{self.runs}"
            cfg = RunConfig(tuple(base), Api(s.emulator.model, s.endpoint, request_ids=tag),
                            retry_429=arm.retry_429, failover=len(gws) > 1)
            t0 = time.monotonic()
            before = {e["name"]: e for e in self.fleet.stats()}
            cpu0 = _router_cpu(gws)
            thread = None
            done = threading.Event()
            if during is not None:
                thread = threading.Thread(target=lambda: side.update(during(gws, done)),
                                          daemon=True)
                thread.start()
            try:
                res = benchmark(src, workload, cfg, s.slo_ttft_ms * s.dilation,
                                s.slo_tpot_ms * s.dilation, metrics_urls=self.fleet.urls,
                                label=arm.name, sample_interval_s=0)
            finally:
                done.set()
            if thread is not None:
                thread.join(600)
                res["during"] = side
            res["wall_s"] = time.monotonic() - t0
            res["load_average"] = os.getloadavg()[0]
            res["router_cpu_s"] = _router_cpu(gws) - cpu0 if gws else None
            after = self.fleet.stats(since=t0)
            res["emulator"] = engine_account(before, after)
            res["engine_requests"] = [r for r in self.fleet.records()
                                      if (r.get("request_id") or "").startswith(tag + "/")]
        finally:
            for g in gws:
                g.stop()
        res["rep"] = rep
        res["dilation"] = s.dilation
        return res


    def run_pd(self, arm: Arm, workload: Workload, src: TokenSource, rep: int,
               prefill: int) -> dict[str, Any]:
        """:meth:`run_arm` with the first ``prefill`` instances prefill-only and the rest
        decode-only (Mooncake's split: our router hands each request's KV from its
        prefill instance to its decode instance through the store); ``arm``'s ``pd``
        option is dropped. Hits count on the prefill instances only: a decode instance
        loading the prompt its prefill just computed is the P/D transfer, not reuse
        (counted, the engines' counters would give a hit rate near 2)."""
        n = len(self.fleet.urls)
        if not 0 < prefill < n:
            raise ValueError(f"a P/D split needs 1 to {n - 1} prefill instances, not {prefill}")
        saved = self.setup
        self.setup = replace(saved, roles=tuple("prefill" if i < prefill else "decode"
                                                for i in range(n)))
        try:
            opts = {k: v for k, v in arm.gateway_opts.items() if k != "pd"}
            res = self.run_arm(replace(arm, gateway_opts=opts), workload, src, rep)
        finally:
            self.setup = saved
        res["prefill_engines"] = [s["name"] for s in self.fleet.specs[:prefill]]
        return prefill_hits(res, set(res["prefill_engines"]))


def prefill_hits(res: dict[str, Any], prefill: set[str]) -> dict[str, Any]:
    """``res`` with its hit tokens (and rate) counted on the ``prefill`` engines only,
    from the engines' per-request records; the decode side's loads are kept as
    ``server_metrics["pd_transfer_tokens"]``."""
    recs = res["engine_requests"]
    local = sum(r["local_hit"] for r in recs if r["engine"] in prefill)
    external = sum(r["external_hit"] for r in recs if r["engine"] in prefill)
    s = res["summary"]
    s["hit_tokens"] = float(local + external)
    s["hit_rate"] = s["hit_tokens"] / s["total_input_tokens"] if s["total_input_tokens"] else None
    res["server_metrics"] = {**res["server_metrics"], "hit_tokens_local": float(local),
                             "hit_tokens_external": float(external),
                             "pd_transfer_tokens": float(sum(
                                 r["local_hit"] + r["external_hit"] for r in recs
                                 if r["engine"] not in prefill))}
    return res


def _router_cpu(gws: list[Gateway]) -> float:
    """CPU seconds the routers' process groups have used so far (a router restarted
    meanwhile counts from its restart)."""
    pgids = []
    for g in gws:
        if g.proc is not None and g.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                pgids.append(os.getpgid(g.proc.pid))
    return group_cpu_seconds(pgids)


def engine_account(before: dict[str, dict[str, Any]],
                   after: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the engines did during a run: busy seconds per engine and the emulator's
    own lateness (how late steps ended because its event loop was busy)."""
    busy = [a["busy_s"] - before[a["name"]]["busy_s"] for a in after]
    lag = [a["lag_p99_s"] or 0.0 for a in after]
    return {"busy_s": busy, "busy_total_s": sum(busy), "busy_max_s": max(busy),
            "lag_p99_max_s": max(lag), "lag_max_s": max(a["lag_max_s"] or 0.0 for a in after),
            "loop_lag_p99_s": after[0].get("loop_lag_p99_s"),
            "loop_lag_max_s": after[0].get("loop_lag_max_s")}


TIMES = ("ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_mean_ms")
RATES = ("goodput", "request_throughput")


def summary_row(res: dict[str, Any]) -> dict[str, Any]:
    """The per-run numbers a fleet result keeps for every repetition, in emulated time
    (a dilated run's times divided by its dilation, its rates multiplied)."""
    s = res["summary"]
    d = float(res.get("dilation", 1.0))
    keys = (*TIMES, *RATES, "slo_attainment", "hit_rate", "hit_tokens", "completed",
            "failed", "rejected", "prediction_error_median", "failovers")
    row = {k: s.get(k) for k in keys}
    for k in TIMES:
        row[k] = row[k] / d if row[k] is not None else None
    for k in RATES:
        row[k] = row[k] * d if row[k] is not None else None
    row["rep"] = res["rep"]
    row["wall_s"] = res.get("wall_s")
    row["load_average"] = res.get("load_average")
    row["dilation"] = d
    row["hit_tokens_local"] = res["server_metrics"].get("hit_tokens_local")
    row["hit_tokens_external"] = res["server_metrics"].get("hit_tokens_external")
    row["engine_busy_s"] = res["emulator"]["busy_total_s"] / d
    row["emulator_lag_p99_max_s"] = res["emulator"]["lag_p99_max_s"] / d
    row["emulator_loop_lag_max_s"] = (res["emulator"].get("loop_lag_max_s") or 0.0) / d
    cpu = res.get("router_cpu_s")
    row["router_cpu_ms_per_request"] = (cpu * 1e3 / max(1, s["completed"])
                                        if cpu is not None else None)
    routed = [r["router_s"] for r in res["requests"] if r.get("router_s") is not None]
    row["router_added_p50_ms"] = (float(np.percentile(routed, 50)) * 1e3 / d
                                  if routed else None)
    row["router_added_p99_ms"] = (float(np.percentile(routed, 99)) * 1e3 / d
                                  if routed else None)
    return row


def workload_dict(w: Workload, spec: Any) -> dict[str, Any]:
    return {"spec": asdict(spec), "requests": w.num_requests, **w.info}


def dump(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc))
