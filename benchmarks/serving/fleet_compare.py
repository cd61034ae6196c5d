"""How do the routers compare on a fleet of 8-64 engines (emulated, calibrated)?

    python -m benchmarks.serving.fleet_compare hotprefix --instances 8 [--reps 3] [--quick]
    python -m benchmarks.serving.fleet_compare multiturn --instances 32
    python -m benchmarks.serving.fleet_compare trace --instances 64 [--trace FILE]
    python -m benchmarks.serving.fleet_compare pd --instances 8   # P/D split vs both roles

The same arms as :mod:`benchmarks.serving.compare` (client round-robin; sglang-router,
SMG and vllm-router cache-aware; our router, with replication, with admission) in front
of ``--instances`` emulated engines (:mod:`benchmarks.emulator`, the profile measured on
vLLM CPU: ``benchmarks/emulator/profiles/vllm_cpu_bench.json``; each engine its own
processor, as engines on separate GPUs) that share one local store (every arm gets the
store's hits, as with the kvcentric connector on every engine). Every arm runs the
workload ``--reps`` times (3 by default; arms' order rotated each repetition, seed
``--seed + rep``, caches emptied before every run). Per arm the result keeps every
repetition's numbers and their median and range. ``--arms`` also takes our router
running one of its baseline policies (:mod:`kvcentric.router.policies`):
``kvcentric-round_robin``, ``kvcentric-random``, ``kvcentric-least_loaded``,
``kvcentric-engine_cache``.

Workloads (request rates scale with the fleet): ``hotprefix``: a few long shared
prefixes, Zipf-popular, each request a prefix and its own question (each prefix served
once through the arm before the timed run, untimed, unless ``--cold``); ``multiturn``:
users with a shared system prompt and a private context, turns after think time (chat);
``trace``: Mooncake's conversation trace, whole conversations sampled, tokens and time
scaled; ``pd``: the hot-prefix workload on half prefill, half decode instances (our
router's P/D arms next to the same arms on ``both`` instances).

Writes ``benchmarks/results/fleet_<workload>_<N>[_quick].json`` (``arms``: label,
median ``summary``, every repetition) and a PNG of TTFT mean/p90/p99 and goodput.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.emulator.launch import EmulatorSpec
from benchmarks.lib import results_writer as rw
from benchmarks.lib.lifetime import stop_on_sigterm
from benchmarks.lib.paths import LOGS, RESULTS, ROOT
from benchmarks.serving.compare import OUR_ARMS, OUR_ROUTER, PEER_CACHE_AWARE, POLICY_ARMS
from benchmarks.serving.fleet import Arm
from benchmarks.serving.fleet_report import aggregate, figure, per_request, table
from benchmarks.serving.fleet_runs import (
    FleetRun,
    FleetSetup,
    split_cpus,
    summary_row,
    workload_dict,
)
from kvcentric.bench_serving.tokens import TokenSource
from kvcentric.bench_serving.workloads import Session, Turn, Workload, WorkloadSpec, build
from kvcentric.testing.models import build_model

TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
ARMS = [Arm("round-robin"), *PEER_CACHE_AWARE, *OUR_ARMS]
CALIBRATION = RESULTS / "emulator_calibration.json"


def workload_spec(args: argparse.Namespace, n: int, seed: int) -> tuple[WorkloadSpec, str]:
    """The workload for ``n`` instances (and the endpoint it uses)."""
    q = args.quick
    d = args.dilation  # wall seconds per emulated second
    scale = args.rate_scale / d
    if args.workload in ("hotprefix", "pd"):
        groups = args.groups or max(2, n // 4)
        return WorkloadSpec(
            workload="shared-prefix", seed=seed, num_groups=groups,
            prompts_per_group=max(4, round(args.requests_per_instance * n / groups)),
            shared_system_prompt_len=args.prefix_len, turn_input_len=args.question_len,
            output_len=16, request_rate=args.rate_per_instance * n * scale,
            group_skew=args.skew), "completions"
    if args.workload == "multiturn":
        users = max(4, round(args.users_per_instance * n))
        return WorkloadSpec(
            workload="multi-turn", seed=seed, num_users=users, turns_mean=3 if q else 5,
            turns_std=1.0, shared_system_prompt_len=512, user_context_len=1536,
            turn_input_len=96, output_len=16, turn_gap=2.0 * d,
            user_rate=args.rate_per_instance * n * scale / 2.5), "chat"
    return WorkloadSpec(
        workload="trace", seed=seed, trace=args.trace, max_requests=args.max_requests,
        sample_sessions=min(1.0, args.sample_per_instance * n), scale_tokens=1 / 8,
        time_scale=args.time_scale / scale, max_input_len=6000), "completions"


def warmed(w: Workload) -> Workload:
    """``w`` with each shared prefix served once first (through the arm, untimed; one
    token of answer, the question a token of its own): a hot prefix is hot because it was
    asked before, so the timed run measures steady state, not every arm's identical cold
    prefills (the first seconds' requests find nothing anywhere)."""
    systems = dict.fromkeys(s.system for s in w.sessions)
    warm = [Session(f"warm{i}", 0.0, (Turn(s.turns[0].user[:1], 1),), system)
            for i, (system, s) in enumerate(
                (sy, next(x for x in w.sessions if x.system == sy)) for sy in systems)]
    return replace(w, warmup=[*w.warmup, *warm], info={**w.info, "warmup_prefixes": len(warm)})


def arms_for(args: argparse.Namespace) -> list[Arm]:
    if args.workload == "pd":
        pd = [replace(a, name=a.name + "-pd", gateway_opts={**a.gateway_opts, "pd": True})
              for a in (OUR_ROUTER, OUR_ARMS[1])]
        return [Arm("round-robin"), OUR_ROUTER, OUR_ARMS[1], *pd]
    if args.arms:
        names = args.arms.split(",")
        return [a for a in [*ARMS, *POLICY_ARMS] if a.name in names]
    return ARMS


def calibration_error() -> float | None:
    try:
        return float(json.loads(CALIBRATION.read_text())["summary"]["calibration_error_max"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    n = args.instances
    model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    name = (f"fleet_{args.workload}_{n}{'_nostore' if args.no_store else ''}"
            f"{'_quick' if args.quick else ''}{args.tag}")
    logs = LOGS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    emu_cpus, rest = split_cpus()
    if rest:
        os.sched_setaffinity(0, rest)  # the client (and the store it starts) with routers
    if args.dilation is None:  # keep the CPU work per wall second about that of 16 engines
        args.dilation = max(1.0, n / 16)
    emu = EmulatorSpec(instances=n, tokenizer=model, profile=args.profile, pages=args.pages,
                       max_model_len=8192, cpus=emu_cpus, dilation=args.dilation)
    arms = arms_for(args)
    setup = FleetSetup(emu, args.slo_ttft_ms, args.slo_tpot_ms,
                       endpoint=workload_spec(args, n, args.seed)[1],
                       use_store=not args.no_store, router_cpus=rest,
                       router_extra={"log_level": "debug"} if args.router_debug else {})
    src = TokenSource(model)
    runs: dict[str, list[dict[str, Any]]] = {a.name: [] for a in arms}
    details: dict[str, Any] = {}
    workloads = []
    t0 = time.monotonic()
    with FleetRun(setup, logs) as fr:
        for rep in range(args.reps):
            spec, _ = workload_spec(args, n, args.seed + rep)
            workload = build(spec, src)
            if args.workload in ("hotprefix", "pd") and not args.cold:
                workload = warmed(workload)
            workloads.append(workload_dict(workload, spec))
            print(f"rep {rep}: {workload.num_requests} requests; logs in {logs}", flush=True)
            order = arms[rep % len(arms):] + arms[:rep % len(arms)]
            for arm in order:
                if arm.gateway_opts.get("pd"):
                    res = fr.run_pd(arm, workload, src, rep, len(fr.fleet.urls) // 2)
                else:
                    res = fr.run_arm(arm, workload, src, rep)
                runs[arm.name].append(summary_row(res))
                print(f"  {arm.name}: TTFT mean {res['summary']['ttft_mean_ms']:.0f} ms, "
                      f"p90 {res['summary']['ttft_p90_ms']:.0f} ms, goodput "
                      f"{res['summary']['goodput']:.2f}/s, hit rate "
                      f"{res['summary']['hit_rate'] or 0:.2f}", flush=True)
                if rep == 0:  # every arm: where a peer's requests went explains its TTFT
                    details[arm.name] = per_request(res, fr.fleet.urls)
    arms_out = aggregate(runs)
    by = {a["label"]: a for a in arms_out}
    summary: dict[str, Any] = {"instances": n, "workload": args.workload, "reps": args.reps,
                               "dilation": args.dilation,
                               "calibration_error_max": calibration_error()}
    for metric, lower in (("ttft_mean_ms", True), ("ttft_p90_ms", True), ("goodput", False)):
        vals = {k: v["summary"][metric] for k, v in by.items()
                if v["summary"][metric] is not None}
        best = (min if lower else max)(vals, key=lambda k: vals[k]) if vals else None
        summary[f"best_{metric}"] = best
    if "kvcentric-replicate" in by and "kvcentric-router" in by:
        r, p = by["kvcentric-replicate"]["summary"], by["kvcentric-router"]["summary"]
        summary["replication_p90_ratio"] = r["ttft_p90_ms"] / p["ttft_p90_ms"]
        summary["replication_mean_ratio"] = r["ttft_mean_ms"] / p["ttft_mean_ms"]
    summary["wall_s"] = time.monotonic() - t0
    doc = {"title": f"Fleet of {n} emulated engines: {args.workload}", "summary": summary,
           "arms": arms_out, "baseline": "round-robin", "workloads": workloads,
           "fleet": {"emulator": {**emu.__dict__, "store": None if args.no_store else
                                  "one local store, all arms"},
                     "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
                     "engine_cache_pages": args.pages},
           "per_request_rep0": details,
           "notes": ["Engines: benchmarks.emulator (vLLM's scheduler and prefix cache, "
                     f"profile {args.profile}), each its own processor; the emulator "
                     f"process on CPU {emu_cpus}, routers, client and store on {rest}; "
                     + ("no store: each engine reuses only its own prefix cache."
                        if args.no_store else "one local store for all arms (store hits "
                        "timed at the profile's bandwidth)."),
                     "Medians over repetitions; each arm's range is in its reps."]}
    out = RESULTS / f"{name}.json"
    rw.write(out, doc, table(doc), [rw.Figure("ttft", f"{doc['title']}: medians and range",
                                              lambda p: figure(doc, p))],
             command=args.cmdline)
    return doc


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()  # a killed run still stops its fleet and removes its store
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", choices=("hotprefix", "multiturn", "trace", "pd"))
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="8 requests per instance (trace: its first 2000 lines), every "
                         "repetition")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default=None, help="comma-separated arm names (default: all)")
    ap.add_argument("--profile", default="vllm_cpu_bench")
    ap.add_argument("--pages", type=int, default=96, help="engine KV cache pages")
    ap.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=250.0)
    ap.add_argument("--rate-per-instance", type=float, default=0.35)
    ap.add_argument("--rate-scale", type=float, default=1.0, help="multiplies every rate")
    ap.add_argument("--dilation", type=float, default=None,
                    help="run the emulation this many times slower than real time, every "
                         "time reported back in emulated time (default: instances / 16, "
                         "at least 1): the CPU left for routers and client stays the same")
    ap.add_argument("--requests-per-instance", type=float, default=24.0)
    ap.add_argument("--groups", type=int, default=None)
    ap.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of prefixes")
    ap.add_argument("--prefix-len", type=int, default=3072)
    ap.add_argument("--question-len", type=int, default=384)
    ap.add_argument("--users-per-instance", type=float, default=3.0)
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--max-requests", type=int, default=12031)
    ap.add_argument("--sample-per-instance", type=float, default=0.004)
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--no-store", action="store_true",
                    help="engines keep only their own prefix caches (no connector, no store)")
    ap.add_argument("--cold", action="store_true",
                    help="hot-prefix: no warm-up (the timed run starts with every prefix "
                         "uncached)")
    ap.add_argument("--router-debug", action="store_true",
                    help="our routers log every decision's candidates (in the run's logs)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if args.quick:  # fewer requests a run (minutes, not an hour); still --reps runs
        args.requests_per_instance = min(args.requests_per_instance, 8)
        args.max_requests = min(args.max_requests, 2000)  # the trace's first 11 minutes
    args.cmdline = rw.command_line(__file__, argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
