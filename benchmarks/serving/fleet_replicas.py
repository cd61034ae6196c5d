"""Do several router replicas route as well as one, and does a restarted one recover?

    python -m benchmarks.serving.fleet_replicas replicas [--instances 16] [--reps 3]
        [--store] [--quick]
    python -m benchmarks.serving.fleet_replicas soak [--instances 64] [--minutes 30]
        [--probe] [--prompt-cache-chars N] [--tag NAME]

``replicas``: 1, 2, 4 and 8 of our routers (``kvcentric-router``, each its own process,
every one subscribed to every engine's KV events with replay) behind a round-robin client
(a refused connection goes to the next router, as a load balancer fails over), in front
of one emulated fleet (:mod:`benchmarks.emulator`); next to them the SGLang Model Gateway
(``smg`` cache-aware) as 1 and 8 gateways, which learn residency only from the requests
each routes. Engines keep only their own prefix caches (``--store`` adds the shared
store): the hit rate is then routing's alone. Workload: the hot-prefix one (Zipf-popular
long prefixes, each request its own question). Reported per arm (medians of ``--reps``):
hit rate, TTFT mean/p90/p99, goodput; ``replicas_hit_rate_ratio_min`` (the lowest hit
rate of 2/4/8 replicas over one router's) and ``replicas_ttft_ratio_max``.

Then the restart: with 4 replicas, one is killed (SIGKILL) at 40% of the run and started
again 1 s later on the same port. From its start, probes (a hot prefix and a new
question, ``max_tokens`` 1) are sent to it one after another (50 ms apart) until an
answer says it routed by prefix (``x-kvc-hit-tokens`` covering the prefix):
``restart_prefix_routing_s`` is when that probe was sent (its routing was decided then;
its answer waits for the engine), from the restart, also given from the moment the
router was ready (``prefix_after_ready_s``). The
client's failed requests are split into those in flight to the killed replica at the
kill and the rest (which must be 0).

``soak``: ``--instances`` engines with small caches (constant eviction), 2 replicas,
``--minutes`` of new prefixes; every 15 s each router's RSS (its process group, from
/proc) and its bookkeeping (``/instances``: resident blocks, event translator pages).
Reported: RSS slope per router (MiB per 10 minutes, after the first fifth and over the
second half) and the largest page map against its bound (twice the engine's pages).
The prompt token cache (``cache.prompt_text_chars``, 16 Mi characters by default) fills
with every new prefix until its bound: ``--prompt-cache-chars`` sets a smaller one so a
run shows the routers' memory once it is full; ``--trim-interval-s 0`` turns the routers'
periodic ``malloc_trim`` off (the control for it). ``--probe`` runs each router inside
:mod:`benchmarks.reliability.router_probe`: every sample adds its allocators' split
(pymalloc live bytes and arenas, glibc in use, free and mmapped), its bookkeeping sizes
and the objects the GC tracks; after the first fifth and at the end it counts live
objects by type; ``growth`` in the summary is each router's change between those points.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from benchmarks.emulator.launch import EmulatorSpec
from benchmarks.lib import results_writer as rw
from benchmarks.lib.lifetime import stop_on_sigterm
from benchmarks.lib.paths import LOGS, RESULTS
from benchmarks.lib.procfs import group_pids, usage
from benchmarks.reliability.soak_router import growth as snapshots_growth
from benchmarks.reliability.soak_router import probe, snapshot
from benchmarks.serving.compare import OUR_ROUTER
from benchmarks.serving.fleet import Arm
from benchmarks.serving.fleet_report import aggregate, figure, table
from benchmarks.serving.fleet_runs import FleetRun, FleetSetup, split_cpus, summary_row
from benchmarks.serving.gateways import Gateway, gateway_for
from kvcentric.bench_serving.tokens import TokenSource
from kvcentric.bench_serving.workloads import Workload, WorkloadSpec, build
from kvcentric.router.config import MemoryConfig
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import free_port

SMG = Arm("smg-cache_aware", gateway="smg:cache_aware")


def replicas_of(fr: FleetRun, arm: Arm, k: int, sync: bool = True) -> list[Gateway]:
    """``k`` routers of ``arm``'s kind over the fleet; ours tell each other their
    dispatches (``peers``: each binds a loopback port, connects to the others') unless
    ``sync`` is off."""
    if arm.gateway == "kvcentric":
        ports = [free_port() for _ in range(k)] if sync and k > 1 else []
        eps = [f"tcp://127.0.0.1:{p}" for p in ports]
        gws = [fr.gateway(arm, tag=f"-{i}", extra={"peers": {
                   "publish": eps[i], "connect": eps[:i] + eps[i + 1:]}} if eps else None)
               for i in range(k)]
    else:
        gws = [gateway_for(arm.gateway, fr.fleet.urls, fr.logs,
                           tokenizer=fr.setup.emulator.tokenizer) for _ in range(k)]
        for i, g in enumerate(gws):
            if g is not None:
                g.log_path = g.log_path.with_name(f"{g.log_path.stem}-{i}.log")
    out = [g for g in gws if g is not None]
    for g in out:
        g.cpus = fr.setup.router_cpus
    return out


def kill_and_restart(victim: int, at_s: float, down_s: float, probes: list[str],
                     prefix_tokens: int, model: str) -> Any:
    """A ``during`` hook: SIGKILL router ``victim`` at ``at_s`` after the start, start
    it again ``down_s`` later, probe it until it routes by prefix."""
    def run(gws: list[Gateway], done: threading.Event) -> dict[str, Any]:
        g = gws[victim]
        time.sleep(at_s)
        assert g.proc is not None
        t_kill = time.perf_counter()
        os.killpg(os.getpgid(g.proc.pid), signal.SIGKILL)
        g.proc.wait()
        time.sleep(down_s)
        t_start = time.perf_counter()
        g.start()
        g.wait_ready(60)
        t_ready = time.perf_counter()
        t_prefix = None  # when the first probe routed by prefix was sent (decided)
        hits: list[int] = []
        sent: list[float] = []
        with httpx.Client(timeout=60) as c:
            i = 0
            while time.perf_counter() - t_start < 60:
                body = {"model": model, "prompt": probes[i % len(probes)], "max_tokens": 1}
                i += 1
                t_sent = time.perf_counter()
                try:
                    r = c.post(g.url + "/v1/completions", json=body)
                    hit = int(r.headers.get("x-kvc-hit-tokens", "0"))
                except (httpx.HTTPError, ValueError):
                    hit = -1
                hits.append(hit)
                sent.append(t_sent - t_start)
                if hit >= prefix_tokens:
                    t_prefix = t_sent
                    break
                time.sleep(0.05)
        return {"victim": victim, "url": g.url, "t_kill": t_kill, "t_start": t_start,
                "t_ready": t_ready, "t_prefix": t_prefix, "probes": len(hits),
                "probe_hits": hits[:50], "probe_sent_s": sent[:50],
                "ready_s": t_ready - t_start,
                "prefix_routing_s": t_prefix - t_start if t_prefix else None,
                "prefix_after_ready_s": t_prefix - t_ready if t_prefix else None}
    return run


def restart_account(res: dict[str, Any]) -> dict[str, Any]:
    """The restart's numbers from a run: recovery times and failed requests, split into
    those in flight to the killed router at the kill and the rest."""
    d = res["during"]
    t_kill = d["t_kill"] - res["t_origin"]
    failed = [r for r in res["requests"] if not r["success"]]
    inflight = [r for r in res["requests"] if r["url"] == d["url"]
                and r["start_s"] <= t_kill <= r["start_s"] + max(r["latency_s"], 0.0)
                or (not r["success"] and r["url"] == d["url"] and r["start_s"] <= t_kill)]
    in_flight_failed = [r for r in failed if r in inflight]
    return {"prefix_routing_s": d["prefix_routing_s"], "ready_s": d["ready_s"],
            "prefix_after_ready_s": d.get("prefix_after_ready_s"),
            "probe_hits": d.get("probe_hits"), "probe_sent_s": d.get("probe_sent_s"),
            "probes": d["probes"], "in_flight_at_kill": len(inflight),
            "failed_in_flight": len(in_flight_failed),
            "failed_other": len(failed) - len(in_flight_failed),
            "failovers": sum(r.get("failovers", 0) for r in res["requests"]),
            "failure_reasons": sorted({r["error"][:120] for r in failed})}


def hot_workload(args: argparse.Namespace, n: int, seed: int, d: float) -> WorkloadSpec:
    return WorkloadSpec(workload="shared-prefix", seed=seed, num_groups=args.groups or n,
                        prompts_per_group=max(2, round(args.requests_per_instance)),
                        shared_system_prompt_len=args.prefix_len, turn_input_len=256,
                        output_len=16, request_rate=args.rate_per_instance * n / d,
                        group_skew=args.skew)


def fleet_setup(args: argparse.Namespace, dilation: float) -> FleetSetup:
    """The emulated fleet of ``args.instances`` engines at ``dilation`` on half the CPUs,
    this process (client and routers) pinned to the rest."""
    model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    emu_cpus, rest = split_cpus()
    if rest:
        os.sched_setaffinity(0, rest)
    return FleetSetup(EmulatorSpec(args.instances, model, pages=args.pages,
                                   max_model_len=8192, cpus=emu_cpus, dilation=dilation),
                      args.slo_ttft_ms, args.slo_tpot_ms, use_store=args.store,
                      router_cpus=rest,
                      # replicas learn each other's queues from the engines' gauges: read
                      # them every second (the default 5 s lets them herd in between)
                      router_extra={"health": {"metrics_interval_s": 1.0}})


def replicas(args: argparse.Namespace) -> dict[str, Any]:
    n = args.instances
    d = args.dilation or max(1.0, n / 16)
    name = (f"fleet_replicas_{n}{'_store' if args.store else ''}"
            f"{'_quick' if args.quick else ''}{args.tag}")
    logs = LOGS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    setup = fleet_setup(args, d)
    counts = [1, 2, 4] if args.quick else [1, 2, 4, 8]
    arms = [(f"kvcentric-router x{k}", OUR_ROUTER, k) for k in counts]
    arms += [(f"kvcentric-router x{counts[-1]} nosync", OUR_ROUTER, counts[-1])]
    arms += [(f"smg-cache_aware x{k}", SMG, k) for k in (1, counts[-1])]
    src = TokenSource(setup.emulator.tokenizer)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in arms}
    restarts = []
    t0 = time.monotonic()
    with FleetRun(setup, logs) as fr:
        for rep in range(args.reps):
            spec = hot_workload(args, n, args.seed + rep, d)
            w = build(spec, src)
            order = arms[rep % len(arms):] + arms[:rep % len(arms)]
            for label, arm, k in order:
                def make(a: Arm, k: int = k, arm: Arm = arm,
                         sync: bool = "nosync" not in label) -> list[Gateway]:
                    return replicas_of(fr, arm, k, sync)

                res = fr.run_arm(replace(arm, name=label.replace(" ", "")), w, src, rep,
                                 gateways=make)
                runs[label].append(summary_row(res))
                s = res["summary"]
                print(f"  {label}: hit rate {s['hit_rate'] or 0:.3f}, TTFT mean "
                      f"{s['ttft_mean_ms'] / d:.0f} ms, failed {s['failed']}", flush=True)
            # the restart, once per repetition, 4 replicas
            res = restart_run(fr, w, src, rep, spec, d)
            restarts.append(restart_account(res) | {"summary": summary_row(res)})
            print(f"  restart: {restarts[-1]}", flush=True)
    arms_out = aggregate(runs)
    by = {a["label"]: a["summary"] for a in arms_out}
    one = by["kvcentric-router x1"]
    ratios = {k: by[f"kvcentric-router x{k}"]["hit_rate"] / one["hit_rate"]
              for k in counts[1:]}
    ttft = {k: by[f"kvcentric-router x{k}"]["ttft_mean_ms"] / one["ttft_mean_ms"]
            for k in counts[1:]}
    nosync = by[f"kvcentric-router x{counts[-1]} nosync"]
    smg_ratio = (by[f"smg-cache_aware x{counts[-1]}"]["hit_rate"]
                 / by["smg-cache_aware x1"]["hit_rate"])
    rs = [r["prefix_routing_s"] for r in restarts if r["prefix_routing_s"] is not None]
    summary = {"instances": n, "dilation": d, "reps": args.reps, "store": args.store,
               "replicas_hit_rate_ratio_min": min(ratios.values()),
               "replicas_hit_rate_ratio": ratios,
               "replicas_ttft_ratio_max": max(ttft.values()), "replicas_ttft_ratio": ttft,
               "nosync_hit_rate_ratio": nosync["hit_rate"] / one["hit_rate"],
               "nosync_ttft_ratio": nosync["ttft_mean_ms"] / one["ttft_mean_ms"],
               "smg_hit_rate_ratio_8_over_1": smg_ratio,
               "restart_prefix_routing_s_max": max(rs) if rs else None,
               "restart_prefix_routing_s": rs,
               "restart_prefix_after_ready_s": [r.get("prefix_after_ready_s")
                                                for r in restarts],
               "restart_failed_other_max": max(r["failed_other"] for r in restarts),
               "restart_failed_in_flight": [r["failed_in_flight"] for r in restarts],
               "wall_s": time.monotonic() - t0}
    doc: dict[str, Any] = {
           "title": f"Router replicas over {n} emulated engines (hot prefixes)",
           "summary": summary, "arms": arms_out, "restarts": restarts,
           "workload": hot_workload(args, n, args.seed, d).__dict__,
           "notes": ["Replicas: independent router processes, every one fed by every "
                     "engine's KV events (vLLM's wire format, with replay) and, except "
                     "the 'nosync' arm, by the other replicas' dispatches (router peers "
                     "over ZMQ on loopback); the client "
                     "round-robins over them and fails a refused connection over to the "
                     "next, as a load balancer does.",
                     f"Engines: benchmarks.emulator, profile vllm_cpu_bench, dilation {d}, "
                     + ("one shared store." if args.store else
                        "no store: hits come only from routing to the engine that holds "
                        "the prefix.")]}
    rw.write(RESULTS / f"{name}.json", doc, table(doc),
             [rw.Figure("ttft", doc["title"], lambda p: figure(doc, p))],
             command=rw.command_line(__file__, args.argv))
    return doc


def restart_run(fr: FleetRun, w: Workload, src: TokenSource, rep: int, spec: WorkloadSpec,
                d: float) -> dict[str, Any]:
    """4 replicas; replica 1 killed at 40% of the run, back 1 s later, probed."""
    first = [s for s in w.sessions if s.system]
    hot = max({s.system for s in first}, key=lambda sys_: sum(s.system == sys_ for s in first))
    probes = [src.text(hot) + src.text(src.random_ids(random.Random(i), 64)) for i in range(8)]
    duration = w.sessions[-1].start_s
    arm = replace(OUR_ROUTER, name="kvcentric-router-restart")
    block = 128
    return fr.run_arm(arm, w, src, rep, gateways=lambda a: replicas_of(fr, OUR_ROUTER, 4),
                      during=kill_and_restart(1, 0.4 * duration, 1.0, probes,
                                              (len(hot) // block - 1) * block,
                                              fr.setup.emulator.model))


def soak(args: argparse.Namespace) -> dict[str, Any]:
    n = args.instances
    d = args.dilation or max(1.0, n / 16)
    logs = LOGS / f"fleet_soak_{n}-{time.strftime('%Y%m%d-%H%M%S')}"
    setup = fleet_setup(args, d)
    if args.prompt_cache_chars is not None:
        setup = replace(setup, router_extra={**setup.router_extra, "cache": {
            "prompt_text_chars": args.prompt_cache_chars}})
    if args.trim_interval_s is not None:
        setup = replace(setup, router_extra={**setup.router_extra, "memory": {
            "trim_interval_s": args.trim_interval_s}})
    rate = args.rate_per_instance * n  # emulated requests/s
    total = int(rate * args.minutes * 60 / d)
    spec = WorkloadSpec(workload="shared-prefix", seed=args.seed, num_groups=max(1, total // 4),
                        prompts_per_group=4, shared_system_prompt_len=1024,
                        turn_input_len=128, output_len=8, request_rate=rate / d)
    src = TokenSource(setup.emulator.tokenizer)
    w = build(spec, src)
    samples: list[dict[str, Any]] = []
    probe_dirs = [logs / f"probe-{k}" for k in range(args.replicas)] if args.probe else []
    warm_s = 0.2 * args.minutes * 60  # the run lasts --minutes of wall time

    def sampler(gws: list[Gateway], done: threading.Event) -> dict[str, Any]:
        t0 = time.perf_counter()
        snapped = False
        while not done.is_set():
            row: dict[str, Any] = {"t_s": time.perf_counter() - t0, "routers": []}
            if probe_dirs and not snapped and row["t_s"] >= warm_s:
                snapped = snapshot_all(gws, probe_dirs, 0)
            for k, g in enumerate(gws):
                assert g.proc is not None
                rss, fds = usage(group_pids(os.getpgid(g.proc.pid)))
                try:
                    inst = httpx.get(g.url + "/instances", timeout=30).json()["instances"]
                except (httpx.HTTPError, ValueError, KeyError):
                    inst = []
                row["routers"].append({
                    "rss_mib": rss, "fds": fds,
                    "resident_blocks": sum(i.get("resident_blocks", 0) for i in inst),
                    "kv_event_pages": sum(i.get("kv_event_pages", 0) for i in inst),
                    "kv_event_pages_max": max((i.get("kv_event_pages", 0) for i in inst),
                                              default=0),
                    **(probe(g.proc, probe_dirs[k]) if probe_dirs else {})})
            samples.append(row)
            done.wait(args.sample_s)
        if probe_dirs and snapped:
            snapshot_all(gws, probe_dirs, 1)
        return {}

    t0 = time.monotonic()
    with FleetRun(setup, logs) as fr:
        arm = replace(OUR_ROUTER, name="kvcentric-router-soak")
        res = fr.run_arm(arm, w, src, 0, during=sampler,
                         gateways=lambda a: probed(replicas_of(fr, OUR_ROUTER, args.replicas),
                                                   probe_dirs))
    def slopes_from(fraction: float) -> list[float | None]:
        since = fraction * samples[-1]["t_s"] if samples else 0.0
        out: list[float | None] = []
        for k in range(args.replicas):
            pts = [(s["t_s"], s["routers"][k]["rss_mib"]) for s in samples
                   if s["t_s"] >= since]
            out.append(_slope(pts) * 600 if len(pts) >= 3 else None)
        return out

    slopes = slopes_from(0.2)
    pages_max = max((r["kv_event_pages_max"] for s in samples for r in s["routers"]), default=0)
    summary = {"instances": n, "dilation": d, "minutes": args.minutes, "requests": len(w.sessions),
               "replicas": args.replicas, "rss_slope_mib_per_10min": slopes,
               "rss_slope_last_half_mib_per_10min": slopes_from(0.5),
               "prompt_cache_chars": args.prompt_cache_chars,
               "trim_interval_s": (MemoryConfig().trim_interval_s if args.trim_interval_s is None
                                   else args.trim_interval_s),
               "rss_first_mib": [r["rss_mib"] for r in samples[0]["routers"]] if samples else None,
               "rss_last_mib": [r["rss_mib"] for r in samples[-1]["routers"]] if samples else None,
               "kv_event_pages_max": pages_max, "kv_event_pages_bound": 2 * args.pages,
               "completed": res.get("summary", {}).get("completed"),
               "failed": res.get("summary", {}).get("failed"),
               "wall_s": time.monotonic() - t0}
    if probe_dirs:
        summary["growth"] = [growth(samples, k, d) for k, d in enumerate(probe_dirs)]
    doc: dict[str, Any] = {
           "title": f"Router memory over a {args.minutes}-minute run at {n} engines",
           "summary": summary, "samples": samples, "workload": spec.__dict__}
    text = "\n".join(f"{k}: {v}" for k, v in summary.items())
    rw.write(RESULTS / f"fleet_soak_{n}{args.tag}.json", doc, text,
             [rw.Figure("rss", doc["title"], lambda p: rss_figure(samples, p))],
             command=rw.command_line(__file__, args.argv))
    return doc


def probed(gws: list[Gateway], dirs: list[Path]) -> list[Gateway]:
    """With ``dirs`` (one per router), each router runs inside
    :mod:`benchmarks.reliability.router_probe` (the same app and config, plus its probes)."""
    for g, outdir in zip(gws, dirs, strict=False):
        outdir.mkdir(parents=True, exist_ok=True)
        config = g.cmd[g.cmd.index("--config") + 1]
        g.cmd = [sys.executable, "-m", "benchmarks.reliability.router_probe", config, str(outdir)]
    return gws


def snapshot_all(gws: list[Gateway], dirs: list[Path], n: int) -> bool:
    """Snapshot ``n`` of every probed router (:func:`~benchmarks.reliability.soak_router.
    snapshot`: live objects by type, its bookkeeping sizes); True when all were written."""
    try:
        for g, d in zip(gws, dirs, strict=True):
            assert g.proc is not None
            snapshot(g.proc, d, n)
    except RuntimeError:
        return False
    return True


def growth(samples: list[dict[str, Any]], k: int, outdir: Path) -> dict[str, Any]:
    """Router ``k``'s growth from the sample a fifth of the way in (about when its first
    snapshot is taken) to the last: RSS and its parts (pymalloc live bytes and arenas,
    glibc in use and heap, objects the GC tracks); with both snapshots, the object types
    whose count changed most and its bookkeeping sizes at each
    (:func:`~benchmarks.reliability.soak_router.growth`)."""
    rows = [s for s in samples if "pymalloc_used_mib" in s["routers"][k]]
    out: dict[str, Any] = {}
    if len(rows) >= 2:
        a, b = rows[len(rows) // 5]["routers"][k], rows[-1]["routers"][k]
        for key in ("rss_mib", "pymalloc_used_mib", "pymalloc_arenas_mib", "glibc_in_use_mib",
                    "glibc_heap_mib", "glibc_mmapped_mib", "gc_objects", "index_blocks",
                    "prompt_cache_chars", "tasks"):
            if key in a and key in b:
                out[f"{key}_delta"] = round(b[key] - a[key], 2)
    if (outdir / "snap1.done").exists():
        out |= snapshots_growth(outdir)
    return out


def _slope(pts: list[tuple[float, float]]) -> float:
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    var = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / var if var else 0.0


def rss_figure(samples: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k in range(len(samples[0]["routers"]) if samples else 0):
        ax.plot([s["t_s"] / 60 for s in samples], [s["routers"][k]["rss_mib"] for s in samples],
                label=f"router {k} RSS")
    ax.set(xlabel="minutes", ylabel="MiB")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()  # a killed run still stops its fleet and removes its store
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("replicas", "soak"))
    ap.add_argument("--instances", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store", action="store_true", help="engines share a store")
    ap.add_argument("--pages", type=int, default=None)
    ap.add_argument("--dilation", type=float, default=None)
    ap.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=250.0)
    ap.add_argument("--rate-per-instance", type=float, default=0.3)
    ap.add_argument("--requests-per-instance", type=float, default=24.0)
    ap.add_argument("--groups", type=int, default=None)
    ap.add_argument("--skew", type=float, default=0.8)
    ap.add_argument("--prefix-len", type=int, default=3072)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--sample-s", type=float, default=15.0)
    ap.add_argument("--tag", default="", help="appended to the result file's name")
    ap.add_argument("--probe", action="store_true",
                    help="soak: routers run with memory probes (allocator split, objects by "
                         "type at warm-up and at the end)")
    ap.add_argument("--prompt-cache-chars", type=int, default=None,
                    help="soak: the routers' cache.prompt_text_chars (default: theirs)")
    ap.add_argument("--trim-interval-s", type=float, default=None,
                    help="soak: the routers' memory.trim_interval_s (0: glibc keeps the "
                         "heap it freed; default: theirs)")
    args = ap.parse_args(argv)
    args.argv = argv
    if args.command == "replicas":
        args.instances = args.instances or 16
        args.pages = args.pages or 96
        if args.quick:
            args.reps = 1
            args.requests_per_instance = min(args.requests_per_instance, 8)
        replicas(args)
    else:
        args.instances = args.instances or 64
        args.pages = args.pages or 48
        soak(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
