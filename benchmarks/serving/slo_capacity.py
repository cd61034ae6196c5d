"""How many requests per second does each routing policy serve within its SLOs, up to saturation?

Effective request capacity under SLO (the Mooncake paper's measure in its evaluation, FAST'25; the
definitions are :mod:`benchmarks.lib.capacity`'s): every arm is offered the same
workload at a sweep of rates, each rate's effective fraction (TTFT and TBT within their
SLOs) measured, and the arm's capacity is the highest rate at which >= 90% of requests
are effective.

    python -m benchmarks.serving.slo_capacity conversation --instances 16 [--reps 3]
        [--requests 3000] [--warmup 0.2] [--rates 2,4,8] [--slo-ttft-s 15]
        [--slo-tbt-s 0.1] [--quick]

Workloads: ``conversation`` and ``synthetic`` (Mooncake's FAST'25 traces, read from
``--trace-dir``, default ``../shared/traces``: their first ``--requests`` requests, arrival
times scaled to each rate), ``hotprefix`` and ``agentic``
(:mod:`benchmarks.sim.workloads`).

Engine: the discrete-event P/D cluster of :mod:`benchmarks.sim.cluster` (``--instances``
split into half prefill, half decode instances), on the H100-class profile of
:class:`~benchmarks.sim.cluster.SimConfig` (an 8B-class GQA model: 128 KiB of KV per
token, prefill ~12k tokens/s with a quadratic attention term, a 25 GB/s store tier,
320-block = 20 GiB engine prefix caches, a 16k-block = 1 TiB store; every field is a
flag). Routing is the router's own policy code (:mod:`kvcentric.router.policies`); the
arms are :data:`benchmarks.sim.cluster.ARMS`: the paper's Figure 5 baselines without a
global pool (``random_nostore``, ``round_robin_nostore``, ``least_load_nostore``,
``local_cache_aware``), the blind ones over the shared store (``random``,
``round_robin``, ``least_load``), a cache-aware router over the engines' caches in front
of the store (``engine_cache_store``), and ours: Algorithm 1 over engine and store tiers
(``kvcentric_noreject``) and with admission (``kvcentric``, 429 for predicted misses).
With a disk tier under the store's DRAM (``--disk-blocks``, read at ``--disk-bw``), both
also run blind to the tiers (``*_tierblind``: every stored block priced at the DRAM
bandwidth), and ``summary.tier_aware_over_blind`` is the capacity ratio. On request
(``--arms``), ours without the store (``kvcentric_nostore``, ``kvcentric_noreject_nostore``:
engine caches only, next to ``local_cache_aware``).
The peer routers themselves (vllm-router, SMG, sglang-router) are not in the simulator:
``--engine emulator`` runs the same sweep on emulated engines behind the real routers,
ours and the peers' (:mod:`.slo_fleet`; its flags are in the ``emulator`` group).

Sweep: unless ``--rates`` is given, rates start at a quarter of a nominal capacity (the
prefill instances over one uncached prefill of the workload's mean prompt) and grow by
1.5x; higher rates are added while an arm still holds at the highest, lower ones (down to
an eighth of the first) while an arm misses at the lowest (up to ``--max-rates``); then
``--refine`` rounds each add, per arm, the geometric middle of the two rates around its
crossing. Every arm runs every rate with seeds ``--seed + rep`` (workload and the
simulator's noise), ``--reps`` repetitions (``--sweep-reps`` fewer at the rates that
decide no arm's capacity: the two around each arm's crossing get ``--reps``, re-checked
until the crossings stand on them); rows are medians with the range. The TTFT
CDF and Figure 5's ordering (random > load-balancing > local cache-aware > global
cache-aware in mean TTFT, global >= 10% below local) are taken at 0.8x the best arm's
capacity, one run per arm at seed ``--seed``.

``--checkpoint FILE`` appends every finished point to ``FILE`` and takes the points
already there from it (:mod:`.sweep_points`): a sweep interrupted by a session's end or a
crash resumes with the same command.

Writes ``benchmarks/results/slo_capacity_<workload>_<n>_{sim,emulated}[_quick].json``
(``arms``: label, ``summary.capacity_rps`` and per-rate ``rows``; ``summary``:
``workload``, ``instances``, ``profile``, ``best_baseline``, ``best_baseline_capacity_rps``,
``best_ours``, ``ours_over_best_baseline``, ``best_peer_capacity_rps`` and
``ours_over_best_peer`` (emulated: the peer routers), ``figure5_ordering_holds``,
``router_added_ttft_p50_ms`` and ``router_cpu_ms_per_request`` (emulated: the best of ours
at 0.8x the best capacity)) and PNGs of the effective fraction vs rate and the TTFT CDF.
Emulated sweeps also write ``<that name>_requests.jsonl.gz``: every request of every run,
where it ran and what our router predicted against the TTFT it got (``per_request``), so
a loss can be explained request by request.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from benchmarks.lib import capacity as cap
from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS, ROOT
from benchmarks.serving.sweep_points import SavedPoints, run_key
from benchmarks.sim import workloads as wl
from benchmarks.sim.cluster import ARMS, Cluster, Outcome, Request, SimConfig

TRACES = ROOT.parent / "shared" / "traces"
WORKLOADS = ("conversation", "synthetic", "hotprefix", "agentic")
OURS = ("kvcentric", "kvcentric_noreject")
FIGURE5 = ("random_nostore", "least_load_nostore", "local_cache_aware", "kvcentric_noreject")
STEP = 1.5
LOWEST_HALVINGS = 3  # how far below the first rate the sweep looks for an arm's crossing
# TTFT SLO by workload: the traces' and the agent's longest prompts take 5-30 s alone and
# uncached on this profile, so a tighter SLO would be missed at any load by a few percent
# of requests whatever the router does; hot-prefix prompts take ~1 s alone
SLO_TTFT_S = {"conversation": 15.0, "synthetic": 15.0, "agentic": 15.0, "hotprefix": 5.0}


def requests_for(args: argparse.Namespace, rate: float, seed: int) -> list[Request]:
    """The workload at ``rate`` requests/s; traces are read once (``args.trace_cache``)."""
    if args.workload in ("conversation", "synthetic"):
        if args.trace_cache is None:
            args.trace_cache = wl.read_trace(args.trace_dir / f"{args.workload}_trace.jsonl",
                                             args.requests)
        return wl.trace(args.trace_cache, rate)
    if args.workload == "hotprefix":
        return wl.HotPrefix().build(args.requests, rate, seed)
    return wl.Agentic(tbt_s=args.cfg.tbt_base).build(args.requests, rate, seed)


def served(o: Outcome) -> cap.Served:
    """A simulated outcome as :mod:`benchmarks.lib.capacity` counts it (the simulator's
    TBT is the request's steady gap, so the paper's longest-10% mean is that gap)."""
    if o.ttft is None:
        return cap.Served(None, 0.0, o.n, rejected=True)
    return cap.Served(o.ttft, o.tbt, o.n, o.local_tokens, o.hit_tokens - o.local_tokens)


def nominal_rps(cfg: SimConfig, reqs: Sequence[Request]) -> float:
    """Prefill instances over one uncached prefill of the mean prompt."""
    n = round(statistics.fmean(r.n for r in reqs))
    return cfg.prefill / cfg.prefill_s(n, 0)


class Engine(Protocol):
    """What a sweep runs on: ``point`` serves the workload at ``rate`` (repetition
    ``rep``'s seed) through ``arm`` and returns its rate row and counted outcomes."""

    arms: list[str]

    def point(self, arm: str, rate: float, rep: int
              ) -> tuple[dict[str, Any], list[cap.Served]]: ...


class SimEngine:
    """The simulated cluster (:mod:`benchmarks.sim.cluster`); ``ValueError`` for an
    unknown arm."""

    ours = OURS
    peers: tuple[str, ...] = ()  # the peers' routers are not in the simulator
    figure5 = FIGURE5
    # no per-run fleet numbers, no per-request file: the rows say all a simulation knows
    runs: tuple[dict[str, Any], ...] = ()
    request_log: tuple[dict[str, Any], ...] = ()

    def __init__(self, args: argparse.Namespace, slo: cap.Slo) -> None:
        self.args = args
        self.arms = args.arms.split(",") if args.arms else default_arms(args.cfg)
        unknown = set(self.arms) - set(ARMS)
        if unknown:
            raise ValueError(f"unknown arms {sorted(unknown)}; known: {', '.join(ARMS)}")
        args.cfg = replace(args.cfg, slo_ttft=slo.ttft_s, slo_tbt=slo.tbt_s)
        self.slo = slo
        self._reqs: dict[tuple[float, int], list[Request]] = {}

    def __enter__(self) -> SimEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    @staticmethod
    def baseline(arm: str) -> bool:
        return not arm.startswith("kvcentric")

    def nominal_rps(self) -> float:
        return nominal_rps(self.args.cfg, self.requests(1.0, 0))

    def info(self) -> dict[str, Any]:
        cfg = self.args.cfg
        return {"title": f"{self.args.instances} simulated instances "
                         f"({cfg.prefill}P+{cfg.decode}D)",
                "summary": {"profile": "SimConfig (H100-class 8B GQA model; see config)",
                            "requests_per_point": len(self.requests(1.0, 0))},
                "config": asdict(cfg),
                "notes": ["Engine: benchmarks.sim.cluster (discrete events, the router's "
                          "own policies); peers' routers are not in it."]}

    def requests(self, rate: float, rep: int) -> list[Request]:
        key = (rate, rep)
        if key not in self._reqs:
            self._reqs = {key: requests_for(self.args, rate, self.args.seed + rep)}
        return self._reqs[key]

    def point(self, arm: str, rate: float, rep: int
              ) -> tuple[dict[str, Any], list[cap.Served]]:
        cfg = replace(self.args.cfg, seed=self.args.seed + rep)
        outs = cap.counted([served(o) for o in Cluster(cfg, arm).run(self.requests(rate, rep))],
                           self.args.warmup)
        return cap.rate_point(outs, self.slo, rate, len(outs) / rate), outs


class Sweep:
    """Every arm at every rate and repetition; unless ``fixed``, rates grow or shrink
    until each arm's capacity is bracketed (or ``max_rates`` is reached)."""

    def __init__(self, engine: Engine, reps: int, fixed: bool, max_rates: int,
                 progress: Callable[[str], None] = print, sweep_reps: int | None = None
                 ) -> None:
        self.engine = engine
        self.reps = reps
        # repetitions of a rate that decides no capacity (confirm() brings the deciding
        # ones up to ``reps``): the rates around each crossing are what the result rests on
        self.sweep_reps = min(reps, sweep_reps or reps)
        self.fixed = fixed
        self.max_rates = max_rates
        self.progress = progress
        # (arm, rate) -> one row per repetition
        self.rows: dict[tuple[str, float], list[dict[str, Any]]] = {}

    def measure(self, rate: float, arms: Sequence[str] | None = None,
                reps: int | None = None) -> None:
        """``arms`` (default all) at ``rate`` until each has ``reps`` repetitions there
        (default ``sweep_reps``); repetition ``k`` runs seed ``k`` whenever it runs."""
        arms = list(self.engine.arms if arms is None else arms)
        want = self.sweep_reps if reps is None else reps
        for rep in range(want):
            todo = [a for a in arms if len(self.rows.get((a, rate), [])) == rep]
            if not todo:
                continue
            for arm in todo[rep % len(todo):] + todo[:rep % len(todo)]:  # order rotated
                row, _ = self.engine.point(arm, rate, rep)
                self.rows.setdefault((arm, rate), []).append(row)
        line = ", ".join(f"{arm} {self.fraction(arm, rate):.2f}" for arm in arms)
        self.progress(f"{rate:.3g} req/s: {line}")

    @property
    def rates(self) -> list[float]:
        """The rates every arm ran (the sweep's; refining adds more per arm)."""
        arms = self.engine.arms
        return sorted(r for r in {r for _, r in self.rows}
                      if all((a, r) in self.rows for a in arms))

    def arm_rates(self, arm: str) -> list[float]:
        return sorted(r for a, r in self.rows if a == arm)

    def refine(self, rounds: int) -> None:
        """``rounds`` times, each arm runs once more at the geometric middle of the two
        rates around its crossing (arms sharing a middle run together), so its capacity
        is interpolated over a gap of ``STEP ** (1 / 2 ** rounds)`` instead of ``STEP``."""
        for _ in range(rounds):
            mids: dict[float, list[str]] = {}
            for arm in self.engine.arms:
                pair = self.crossing(arm)
                if pair is not None:
                    mids.setdefault(math.sqrt(pair[0] * pair[1]), []).append(arm)
            for rate, arms in sorted(mids.items()):
                self.measure(rate, arms)

    def crossing(self, arm: str) -> tuple[float, float] | None:
        """The two rates around ``arm``'s first crossing of the threshold (median
        fractions), None when it has none."""
        pts = [(r, self.fraction(arm, r)) for r in self.arm_rates(arm)]
        for (r0, f0), (r1, f1) in zip(pts, pts[1:]):
            if f0 >= cap.THRESHOLD > f1:
                return r0, r1
        return None

    def deciding(self, arm: str) -> list[float]:
        """The rates ``arm``'s capacity rests on, as :func:`capacity.capacity_at` reads
        them: its lowest when it misses there (the capacity is then "below", whatever
        happens higher up), else its :meth:`crossing`, else its highest rate."""
        rates = self.arm_rates(arm)
        if self.fraction(arm, rates[0]) < cap.THRESHOLD:
            return [rates[0]]
        pair = self.crossing(arm)
        return list(pair) if pair is not None else [rates[-1]]

    def confirm(self) -> None:
        """Bring every arm's deciding rates to ``reps`` repetitions; repeat while that
        moves a crossing onto rates measured fewer times (each round adds a
        repetition somewhere, so this ends)."""
        while True:
            short = {(a, r) for a in self.engine.arms for r in self.deciding(a)
                     if len(self.rows[(a, r)]) < self.reps}
            if not short:
                return
            for rate in sorted({r for _, r in short}):
                self.measure(rate, [a for a in self.engine.arms if (a, rate) in short],
                             self.reps)

    def fraction(self, arm: str, rate: float) -> float:
        return statistics.median(r["effective_fraction"] for r in self.rows[(arm, rate)])

    def run(self, rates: Sequence[float]) -> None:
        """Measure ``rates``; unless fixed, add a higher rate while an arm still holds at
        the highest and a lower one while an arm misses at the lowest (down to
        ``rates[0] / 2 ** LOWEST_HALVINGS``: an arm that misses even there is reported
        ``below``), each round both, until ``max_rates`` rates are measured."""
        for r in rates:
            self.measure(r)
        if self.fixed:
            return
        floor = min(rates) / 2 ** LOWEST_HALVINGS
        arms = self.engine.arms
        while len(self.rates) < self.max_rates:
            low, high = self.rates[0], self.rates[-1]
            up = any(self.fraction(a, high) >= cap.THRESHOLD for a in arms)
            down = low / STEP >= floor and any(self.fraction(a, low) < cap.THRESHOLD
                                               for a in arms)
            if not (up or down):
                return
            if up:
                self.measure(high * STEP)
            if down and len(self.rates) < self.max_rates:
                self.measure(low / STEP)

    def arm(self, arm: str) -> dict[str, Any]:
        """``arm``'s capacity; a rate measured fewer than ``reps`` times lends its last
        repetition to the missing ones in ``capacity_rps_reps`` (each row's ``reps``
        says how many it has)."""
        rates = self.arm_rates(arm)
        reps = [[self.rows[(arm, r)][min(k, len(self.rows[(arm, r)]) - 1)] for r in rates]
                for k in range(self.reps)]
        out = cap.arm_capacity(reps)
        for row, r in zip(out["rows"], rates):
            row["reps"] = len(self.rows[(arm, r)])
        return out


def at_load(engine: Engine, rate: float
            ) -> tuple[dict[str, dict[str, Any]], dict[str, list[float]]]:
    """Each arm once at ``rate`` (repetition 0's seed): its row and its served TTFTs."""
    rows, ttfts = {}, {}
    for arm in engine.arms:
        rows[arm], outs = engine.point(arm, rate, 0)
        ttfts[arm] = [o.ttft_s for o in outs if o.ttft_s is not None]
    return rows, ttfts


def best(arms: dict[str, dict[str, Any]], names: Sequence[str]) -> tuple[str | None, float | None]:
    caps = {k: arms[k]["capacity_rps"] for k in names
            if k in arms and arms[k]["capacity_rps"] is not None}
    if not caps:
        return None, None
    k = max(caps, key=lambda x: caps[x])
    return k, caps[k]


def default_arms(cfg: SimConfig) -> list[str]:
    """Every arm but ours without the store (on request) and, without a disk tier, ours
    blind to tiers (identical to ours then)."""
    return [a for a in ARMS if not (a.startswith("kvcentric") and a.endswith("_nostore"))
            and (cfg.disk_blocks or not a.endswith("_tierblind"))]


def ratio(arms: dict[str, dict[str, Any]], a: str, b: str) -> float | None:
    """``a``'s capacity over ``b``'s (None when either has none)."""
    x, y = arms[a]["capacity_rps"], arms[b]["capacity_rps"]
    return x / y if x and y else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    slo = cap.Slo(args.slo_ttft_s or SLO_TTFT_S[args.workload], args.slo_tbt_s)
    t0 = time.monotonic()
    key = run_key(args)  # before an engine adjusts args.cfg to the SLO
    if args.engine == "emulator":
        from benchmarks.serving.slo_fleet import FleetEngine

        engine: SimEngine | FleetEngine = FleetEngine(args, slo)
    else:
        engine = SimEngine(args, slo)
    saved = SavedPoints(engine, args.checkpoint, key) if args.checkpoint else None
    points: Engine = saved or engine
    if saved:
        print(f"saved points: {args.checkpoint} ({len(saved.saved)} there)", flush=True)
    with engine, saved or contextlib.nullcontext():
        nominal = engine.nominal_rps()
        rates = ([float(x) for x in args.rates.split(",")] if args.rates
                 else [nominal * 0.25 * STEP ** k for k in range(args.start_rates)])
        sw = Sweep(points, args.reps, bool(args.rates), args.max_rates,
                   sweep_reps=args.sweep_reps)
        sw.run(rates)
        sw.refine(0 if args.rates else args.refine)  # given rates are swept as given
        sw.confirm()
        arms = engine.arms
        out_arms = {a: sw.arm(a) for a in arms}
        top, top_cap = best(out_arms, arms)
        load = 0.8 * top_cap if top_cap else sw.rates[0]
        at, ttfts = at_load(points, load)
        info = engine.info()
    if saved and saved.reused:
        info["notes"].append(f"{saved.reused} points were measured by an earlier process "
                             f"of this run (same arguments and commit) and taken from "
                             f"{saved.path.name} (--checkpoint).")
    ours = [a for a in arms if a in engine.ours]
    b_name, b_cap = best(out_arms, [a for a in arms if engine.baseline(a)])
    o_name, o_cap = best(out_arms, ours)
    p_name, p_cap = best(out_arms, [a for a in arms if a in engine.peers])
    ttft_at = {a: at[a]["ttft_mean_s"] for a in arms}
    summary = {
        "workload": args.workload, "instances": args.instances, "engine": args.engine,
        **info["summary"], "warmup_share": args.warmup, "reps": args.reps,
        "sweep_reps": sw.sweep_reps,
        "slo_ttft_s": slo.ttft_s, "slo_tbt_s": slo.tbt_s, "nominal_rps": nominal,
        "rates": sw.rates, "best_baseline": b_name, "best_baseline_capacity_rps": b_cap,
        "best_ours": o_name, "best_ours_capacity_rps": o_cap,
        "ours_over_best_baseline": o_cap / b_cap if o_cap and b_cap else None,
        "best_peer": p_name, "best_peer_capacity_rps": p_cap,
        "ours_over_best_peer": o_cap / p_cap if o_cap and p_cap else None,
        "capacity_rps": {a: out_arms[a]["capacity_rps"] for a in arms},
        "figure5_load_rps": load,
        "figure5_ttft_mean_s": {a: ttft_at[a] for a in engine.figure5 if a in ttft_at},
        "figure5_ordering_holds": cap.figure5_ordering(ttft_at, engine.figure5),
        "tier_aware_over_blind": {a: ratio(out_arms, a, f"{a}_tierblind") for a in ours
                                  if f"{a}_tierblind" in out_arms} or None,
        "router_added_ttft_p50_ms": at[o_name].get("router_added_p50_ms") if o_name else None,
        "router_cpu_ms_per_request":
            at[o_name].get("router_cpu_ms_per_request") if o_name else None,
        "wall_s": time.monotonic() - t0}
    doc = {"title": f"Capacity under SLO, {args.workload}, {info['title']}",
           "summary": summary,
           "arms": [{"label": a, "summary": {k: v for k, v in out_arms[a].items()
                                             if k != "rows"},
                     "rows": out_arms[a]["rows"], "at_figure5_load": at[a]} for a in arms],
           "config": info["config"],
           "notes": [*info["notes"],
                     "Rows: medians over repetitions (seed = --seed + rep; a row's reps "
                     "says how many), ranges of the effective fraction and TTFT mean; "
                     "capacity_rps from the median rows, capacity_rps_reps from each "
                     "repetition alone (a rate measured fewer times lends its last)."]}
    kind = "sim" if args.engine == "sim" else "emulated"
    stem = (f"slo_capacity_{args.workload}_{args.instances}_{kind}"
            f"{'_quick' if args.quick else ''}{args.tag}")
    out = Path(args.out or RESULTS / f"{stem}.json")
    if engine.runs:  # each run's fleet numbers (router CPU, hits, engine lag): the why
        doc["runs"] = engine.runs
    if engine.request_log:
        doc["per_request"] = write_requests(out.with_name(out.stem + "_requests.jsonl.gz"),
                                            engine.request_log)
    rw.write(out, doc, table(doc), [
        rw.Figure("effective", "effective fraction vs offered rate",
                  lambda p: figure_effective(doc, engine.ours, p)),
        rw.Figure("cdf", f"TTFT CDF at {load:.3g} req/s",
                  lambda p: figure_cdf(ttfts, load, engine.ours, p))],
        command=args.cmdline)
    return doc


def write_requests(path: Path, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every run's requests (:func:`benchmarks.serving.slo_fleet.request_rows`), one JSON
    object a line, gzipped (reproducibly: no name or time in the header); what the result
    says of the file."""
    data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data, mtime=0))
    return {"file": path.name, "rows": len(rows), "fields": sorted(rows[0]),
            "note": "one line per request of every run (warm-up ones with counted false): "
                    "where it ran, its queueing and hits there, and what our router "
                    "predicted against the TTFT it got, in emulated seconds"}


def table(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    head = f"{'arm':<22} {'capacity':>9} {'found':>12} {'reps':>22} {'TTFT@0.8':>9}"
    lines = [doc["title"], head, "-" * len(head)]
    for a in doc["arms"]:
        c = a["summary"]["capacity_rps"]
        reps = ",".join("-" if x is None else f"{x:.2f}" for x in a["summary"]["capacity_rps_reps"])
        t = a["at_figure5_load"]["ttft_mean_s"]
        lines.append(f"{a['label']:<22} {'-' if c is None else f'{c:.2f}':>9} "
                     f"{a['summary']['capacity_found']:>12} {reps:>22} "
                     f"{'-' if t is None else f'{t:.2f}s':>9}")
    lines.append(f"best baseline {s['best_baseline']} {s['best_baseline_capacity_rps']}, "
                 f"ours {s['best_ours']} {s['best_ours_capacity_rps']}: "
                 f"x{s['ours_over_best_baseline']}; Figure 5 ordering: "
                 f"{s['figure5_ordering_holds']}")
    return "\n".join(lines)


def figure_effective(doc: dict[str, Any], ours: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for a in doc["arms"]:
        rows = a["rows"]
        xs = [r["offered_rps"] for r in rows]
        ys = [r["effective_fraction"] for r in rows]
        lo = [r["effective_fraction"] - r["effective_fraction_range"][0] for r in rows]
        hi = [r["effective_fraction_range"][1] - r["effective_fraction"] for r in rows]
        style = "-" if a["label"] in ours else "--"
        ax.errorbar(xs, ys, yerr=[lo, hi], label=a["label"], linestyle=style, marker="o",
                    markersize=3, capsize=2)
    ax.axhline(cap.THRESHOLD, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("effective fraction (TTFT and TBT within SLO)")
    ax.set_title(doc["title"], fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure_cdf(ttfts: dict[str, list[float]], rate: float, ours: Sequence[str],
               path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for arm, xs in ttfts.items():
        v = np.sort(np.asarray(xs)) if xs else np.array([np.nan])
        ax.plot(v, np.linspace(0, 1, len(v)), label=arm,
                linestyle="-" if arm in ours else "--")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_title(f"TTFT CDF of served requests at {rate:.3g} req/s", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def config(args: argparse.Namespace) -> SimConfig:
    over = {f.name: getattr(args, f.name) for f in fields(SimConfig)
            if getattr(args, f.name, None) is not None}
    half = max(1, args.instances // 2)
    return SimConfig(**{"prefill": half, "decode": max(1, args.instances - half), **over})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workload", choices=WORKLOADS)
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3,
                    help="repetitions at the rates that decide each arm's capacity")
    ap.add_argument("--sweep-reps", type=int, default=None,
                    help="repetitions at the other rates (default --reps)")
    ap.add_argument("--requests", type=int, default=3000, help="requests per rate point")
    ap.add_argument("--warmup", type=float, default=0.2,
                    help="share of each run's first requests served but not counted")
    ap.add_argument("--rates", default=None, help="comma-separated offered rates (req/s)")
    ap.add_argument("--start-rates", type=int, default=8)
    ap.add_argument("--max-rates", type=int, default=14)
    ap.add_argument("--refine", type=int, default=2,
                    help="rounds of one more rate per arm inside its crossing (not with "
                         "--rates)")
    ap.add_argument("--slo-ttft-s", type=float, default=None,
                    help=f"default by workload: {SLO_TTFT_S}")
    ap.add_argument("--slo-tbt-s", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default=None,
                    help=f"comma-separated; simulator: {','.join(ARMS)} (default all but "
                         "ours without the store and, without a disk tier, blind to tiers); "
                         "emulator: benchmarks.serving.slo_fleet.ARMS")
    ap.add_argument("--trace-dir", type=Path, default=TRACES)
    ap.add_argument("--quick", action="store_true", help="1000 requests, 1 repetition")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="append every finished point to this JSON lines file; a rerun "
                         "with the same arguments and commit takes the points there from "
                         "it (an interrupted sweep resumes; benchmarks.serving.sweep_points)")
    ap.add_argument("--engine", choices=("sim", "emulator"), default="sim",
                    help="the simulated cluster, or emulated engines behind real routers "
                         "(benchmarks.serving.slo_fleet)")
    em = ap.add_argument_group("emulator (--engine emulator)")
    em.add_argument("--profile", default="h100_llama8b")
    em.add_argument("--pages", type=int, default=16384,
                    help="engine KV cache pages (16384 of 16 tokens: 32 GiB at 128 KiB a token)")
    em.add_argument("--dilation", type=float, default=None,
                    help="wall seconds per emulated second (default instances / 16, >= 1)")
    em.add_argument("--max-output", type=int, default=64)
    em.add_argument("--scale-tokens", type=float, default=1.0)
    em.add_argument("--max-model-len", type=int, default=131072)
    for f in fields(SimConfig):
        if f.name not in ("seed", "slo_ttft", "slo_tbt"):
            ap.add_argument("--" + f.name.replace("_", "-"), dest=f.name,
                            type=type(f.default), default=None, help=f"default {f.default}")
    args = ap.parse_args(argv)
    if not 0 <= args.warmup < 1:
        ap.error("--warmup must be in [0, 1)")
    if args.instances < (2 if args.engine == "sim" else 1):
        ap.error("--instances must be >= 2 in the simulator (a prefill and a decode "
                 "instance), >= 1 emulated")
    if args.reps < 1 or (args.sweep_reps is not None and args.sweep_reps < 1):
        ap.error("--reps and --sweep-reps must be >= 1")
    if args.quick:
        args.requests, args.reps, args.sweep_reps = min(args.requests, 1000), 1, 1
    args.cfg = config(args)
    args.trace_cache = None
    args.cmdline = rw.command_line(__file__, argv)
    try:
        run(args)
    except ValueError as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
