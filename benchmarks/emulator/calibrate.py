"""Do 2 emulated engines serve a workload as 2 real vLLM CPU engines do (TTFT, hit tokens)?

    python -m benchmarks.emulator.calibrate [--reps 3] [--quick] [--profile vllm_cpu_bench]

(on a machine shared with other vLLM users, inside ``flock /tmp/kvc-vllm.lock``)

The same workloads, the same client, the same settings on both sides: 2 instances of the
``bench`` model (bf16, the comparisons' server flags; each engine's KV cache ``--pages``
pages of 128 tokens; no connector), the client round-robin over them. Where the engines
compute (``--cores``):

* ``own`` (default): each real engine's worker bound to a CPU of its own
  (``VLLM_CPU_OMP_THREADS_BIND``: engine 0 on the first, engine 1 on the second; the API
  servers and the client float), the emulated engines each on a processor of its own
  that slows while the other engine computes, each step by a slowdown drawn from the
  profile's ``host_interference_samples`` (measured apart from this workload on two
  such engines, ``measure --pair``; :class:`benchmarks.emulator.processors.Processor`;
  seeded with the repetition). The rest of the profile is the
  one measured on one engine alone (:mod:`benchmarks.emulator.measure`). Side
  ``separate`` runs the emulator without that term, as the fleet runs emulate engines
  on separate GPUs.
* ``shared``: both real workers on the same core (vLLM's automatic binding with one CPU
  reserved), the emulated engines on one processor shared as measured on two such engines
  (``measure --shared``: :class:`benchmarks.emulator.processors.ExclusiveProcessor`, or
  ``--discipline fair``). Measured: the real side's repetitions spread widely (TTFT mean
  547-1030 ms on the same hot-prefix workload), which no single sharing rule reproduced.

Workloads: ``hotprefix``
(one 3072-token prefix, 64-token questions at a Poisson rate: the engines' prefix
caches and queueing) and
``multiturn`` (users with a shared system prompt, private context, turns after think
time, each user kept on one instance: prefill of growing histories while others decode).

Each side runs every workload ``--reps`` times (the real engines once started per
repetition, prefix caches emptied between workloads). Reported per workload: TTFT mean
and p90 (median over repetitions, with the range) on both sides, their relative errors,
and the prefix-cache hit tokens (which must be equal); ``calibration_error_max`` is the
worst of the mean and p90 errors over the workloads (``separate_error_max`` the same
for side ``separate``). Per side and repetition, ``interference`` says how often the
slowest requests ran while the other engine was busy (:func:`interference`): on this
2-core host the real engines slow each other (their API servers and the client float
onto the workers' CPUs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.emulator.launch import EmulatedFleet, EmulatorSpec
from benchmarks.emulator.profile import load as load_profile
from benchmarks.lib import results_writer as rw
from benchmarks.lib.lifetime import stop_on_sigterm
from benchmarks.lib.paths import RESULTS
from benchmarks.serving.fleet import SERVED_NAME, SERVER_ARGS, pinned_threads_env, warm_up
from kvcentric.bench_serving.client import Api
from kvcentric.bench_serving.loadgen import benchmark
from kvcentric.bench_serving.runner import RunConfig
from kvcentric.bench_serving.tokens import TokenSource
from kvcentric.bench_serving.workloads import Session, Turn, Workload, WorkloadSpec, build
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import VllmServer

TARGET = 0.15


def workloads(quick: bool, seed: int) -> dict[str, tuple[WorkloadSpec, str]]:
    return {
        "hotprefix": (WorkloadSpec(workload="shared-prefix", seed=seed, num_groups=1,
                                   prompts_per_group=24 if quick else 60,
                                   shared_system_prompt_len=3072, turn_input_len=64,
                                   output_len=16, request_rate=0.8), "round-robin"),
        "multiturn": (WorkloadSpec(workload="multi-turn", seed=seed,
                                   num_users=4 if quick else 8, turns_mean=3,
                                   shared_system_prompt_len=512, user_context_len=1024,
                                   turn_input_len=64, output_len=16, turn_gap=3.0,
                                   user_rate=0.25), "session"),
    }


def own_cpu_envs() -> tuple[dict[str, str], dict[str, str]]:
    """The two engines' worker bindings for ``--cores own``: one CPU each."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError("--cores own needs 2 CPUs")
    return ({"VLLM_CPU_OMP_THREADS_BIND": str(cpus[0])},
            {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[1])})


@contextmanager
def real_side(model: str, pages: int, cores: str, logs: Path) -> Iterator[list[str]]:
    envs = own_cpu_envs() if cores == "own" else (pinned_threads_env(),) * 2
    servers = [VllmServer(model, SERVED_NAME, None, "bfloat16", 4096,
                          (*SERVER_ARGS, "--num-gpu-blocks-override", str(pages)),
                          envs[i], logs / f"vllm-{i}.log") for i in range(2)]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(900)
        warm_up(servers, "calibrate")
        for s in servers:
            s.reset_prefix_cache()
        yield [s.url for s in servers]
    finally:
        for s in servers:
            s.stop()


def emulator_spec(model: str, pages: int, profile: str, slowdown: float, discipline: str,
                  cores: str, host_interference: bool = True, seed: int = 0) -> EmulatorSpec:
    """The emulated side's 2 engines. ``cores`` ``own``: a processor each, slowed while
    the other computes by the profile's host interference, drawn per step from its
    measured samples with ``seed`` (``host_interference=False`` or a profile without
    it: separate processors); ``shared``: one processor shared by ``discipline``."""
    x = load_profile(profile).host_interference if host_interference else 0.0
    if cores == "own" and x > 0:
        return EmulatorSpec(2, model, profile=profile, pages=pages, max_model_len=4096,
                            compute="shared", discipline="fair", host_interference=True,
                            seed=seed)
    return EmulatorSpec(2, model, profile=profile, pages=pages, max_model_len=4096,
                        compute="separate" if cores == "own" else "shared",
                        discipline=discipline, slowdown=slowdown)


@contextmanager
def emulated_side(spec: EmulatorSpec, logs: Path) -> Iterator[list[str]]:
    with EmulatedFleet(spec, logs) as f:
        yield f.urls


def run_side(urls: list[str], src: TokenSource, quick: bool, seed: int,
             label: str) -> dict[str, dict[str, Any]]:
    out = {}
    for name, (spec, routing) in workloads(quick, seed).items():
        w: Workload = build(spec, src)
        if name == "hotprefix":  # each engine computes the prefix first: hits then do
            # not depend on whether a request came before another's prefill ended
            sys_ = w.sessions[0].system
            w = Workload(w.name, w.sessions, [Session(f"warm{i}", 0.0, (Turn((), 1),), sys_)
                                              for i in range(len(urls))], w.info)
        cfg = RunConfig(tuple(urls), Api(SERVED_NAME, "completions"), routing=routing)
        res = benchmark(src, w, cfg, metrics_urls=urls, label=f"{label} {name}",
                        sample_interval_s=0)
        s = res["summary"]
        out[name] = {"ttft_mean_ms": s["ttft_mean_ms"], "ttft_p90_ms": s["ttft_p90_ms"],
                     "ttft_p50_ms": s["ttft_p50_ms"], "tpot_mean_ms": s["tpot_mean_ms"],
                     "hit_tokens": s["hit_tokens"], "completed": s["completed"],
                     "failed": s["failed"], "requests": w.num_requests,
                     "interference": interference(res["requests"])}
        print(f"{label} {name}: mean {s['ttft_mean_ms']:.0f} ms p90 {s['ttft_p90_ms']:.0f} ms "
              f"hits {s['hit_tokens']}", flush=True)
        for u in urls:  # next workload starts cold
            import httpx

            httpx.post(u + "/reset_prefix_cache", timeout=30)
    return out


def interference(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether a request's TTFT depends on the *other* engine: for each request, whether
    another engine had a request in flight while it waited for its first token. Reported:
    the share of all requests and of the slowest tenth that overlapped, and the median
    TTFT of each kind (ms). On separate processors (GPUs, the emulator) the shares are
    unrelated; on a host whose engines share CPUs beyond their pinned workers the slowest
    overlap far more often."""
    done = [r for r in records if r.get("success")]
    if not done:
        return {}

    def overlapped(r: dict[str, Any]) -> bool:
        t0, t1 = r["start_s"], r["start_s"] + r["ttft_s"]
        return any(o["url"] != r["url"] and o["start_s"] < t1 and t0 < o["start_s"]
                   + o["latency_s"] for o in done)

    flags = [(r["ttft_s"] * 1000, overlapped(r)) for r in done]
    slow = sorted(flags, reverse=True)[:max(1, len(flags) // 10)]
    with_, alone = [t for t, o in flags if o], [t for t, o in flags if not o]
    return {"overlapped_share": sum(o for _, o in flags) / len(flags),
            "overlapped_share_slowest_tenth": sum(o for _, o in slow) / len(slow),
            "ttft_p50_ms_overlapped": statistics.median(with_) if with_ else None,
            "ttft_p50_ms_alone": statistics.median(alone) if alone else None}


def compare(real: list[dict[str, Any]], emu: list[dict[str, Any]]) -> dict[str, Any]:
    rows = {}
    worst = 0.0
    for name in real[0]:
        row: dict[str, Any] = {}
        for m in ("ttft_mean_ms", "ttft_p90_ms", "ttft_p50_ms", "tpot_mean_ms"):
            r = [x[name][m] for x in real]
            e = [x[name][m] for x in emu]
            rm, em = statistics.median(r), statistics.median(e)
            row[m] = {"real": rm, "emulated": em, "real_range": [min(r), max(r)],
                      "emulated_range": [min(e), max(e)], "relative_error": abs(em - rm) / rm}
        row["hit_tokens"] = {"real": [x[name]["hit_tokens"] for x in real],
                             "emulated": [x[name]["hit_tokens"] for x in emu]}
        row["hit_tokens_equal"] = row["hit_tokens"]["real"] == row["hit_tokens"]["emulated"]
        rows[name] = row
        worst = max(worst, row["ttft_mean_ms"]["relative_error"],
                    row["ttft_p90_ms"]["relative_error"])
    return {"workloads": rows, "calibration_error_max": worst,
            "within_target": worst <= TARGET,
            "hit_tokens_equal": all(r["hit_tokens_equal"] for r in rows.values())}


def table(cmp: dict[str, Any]) -> str:
    lines = [f"{'workload':<10} {'metric':<14} {'real ms':>9} {'emulated':>9} {'error':>7}"]
    for name, row in cmp["workloads"].items():
        for m in ("ttft_mean_ms", "ttft_p90_ms", "ttft_p50_ms", "tpot_mean_ms"):
            r = row[m]
            lines.append(f"{name:<10} {m:<14} {r['real']:>9.0f} {r['emulated']:>9.0f} "
                         f"{r['relative_error']:>7.1%}")
        lines.append(f"{name:<10} hit tokens real {row['hit_tokens']['real']} emulated "
                     f"{row['hit_tokens']['emulated']}")
    lines.append(f"calibration_error_max {cmp['calibration_error_max']:.1%} "
                 f"(target {TARGET:.0%}); hit tokens equal: {cmp['hit_tokens_equal']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()  # a killed run still stops its fleet and removes its store
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--profile", default="vllm_cpu_bench")
    ap.add_argument("--slowdown", type=float, default=1.0)
    ap.add_argument("--cores", default="own", choices=("own", "shared"),
                    help="each engine on a CPU of its own, or both on the same one")
    ap.add_argument("--discipline", default="exclusive", choices=("exclusive", "fair"),
                    help="with --cores shared: how the 2 emulated engines share their processor")
    ap.add_argument("--sides", default="real,emulated,separate",
                    help="real, emulated (with the profile's host_interference under "
                         "--cores own), separate (without it)")
    ap.add_argument("--real-from", type=Path, default=None,
                    help="a calibration result whose real side to compare with (exploring "
                         "emulator settings; the committed result runs both sides)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    src = TokenSource(model)
    logs = Path(tempfile.mkdtemp(prefix="kvc-emu-calibrate-"))
    real: list[dict[str, Any]] = []
    emu: list[dict[str, Any]] = []
    sep: list[dict[str, Any]] = []
    t0 = time.monotonic()
    specs = {k: emulator_spec(model, args.pages, args.profile, args.slowdown, args.discipline,
                              args.cores, host_interference=k == "emulated")
             for k in ("emulated", "separate")}
    sides: dict[str, tuple[Callable[[], Any], list[dict[str, Any]]]] = {
        "real": (lambda: real_side(model, args.pages, args.cores, logs), real),
        "emulated": (lambda: emulated_side(replace(specs["emulated"], seed=rep), logs), emu),
        "separate": (lambda: emulated_side(specs["separate"], logs), sep)}
    if args.real_from is not None:
        import json

        real.extend(json.loads(args.real_from.read_text())["real"][:args.reps])
    for rep in range(args.reps):
        for side in args.sides.split(","):
            make, acc = sides[side]
            with make() as urls:
                acc.append(run_side(urls, src, args.quick, rep, side))
    cmp = compare(real, emu)
    summary = {"calibration_error_max": cmp["calibration_error_max"],
               "within_target": cmp["within_target"],
               "hit_tokens_equal": cmp["hit_tokens_equal"], "target": TARGET,
               "reps": args.reps, "wall_s": time.monotonic() - t0}
    text = table(cmp)
    cmp_sep = None
    if sep:
        cmp_sep = compare(real, sep)
        summary["separate_error_max"] = cmp_sep["calibration_error_max"]
        text += "\n\nwithout host_interference (side separate):\n" + table(cmp_sep)
    doc = {"summary": summary,
           "comparison": cmp, "comparison_separate": cmp_sep,
           "real": real, "emulated": emu, "separate": sep,
           "settings": {"pages": args.pages, "profile": args.profile,
                        "cores": args.cores, "slowdown": args.slowdown,
                        "emulator": specs["emulated"].__dict__,
                        "emulator_separate": specs["separate"].__dict__,
                        "discipline": args.discipline if args.cores == "shared" else None,
                        "real_from": str(args.real_from) if args.real_from else None,
                        "instances": 2,
                        "env": list(own_cpu_envs()) if args.cores == "own"
                        else pinned_threads_env()},
           "workloads": {k: v[0].__dict__ for k, v in workloads(args.quick, 0).items()}}
    out = args.out or RESULTS / f"emulator_calibration{'_quick' if args.quick else ''}.json"
    rw.write(out, doc, text, command=rw.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
