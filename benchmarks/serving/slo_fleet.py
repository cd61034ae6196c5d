"""The emulated fleet as :mod:`.slo_capacity`'s engine: real routers, ours and the peers'.

``python -m benchmarks.serving.slo_capacity <workload> --engine emulator`` runs the
capacity sweep through :class:`FleetEngine`: ``--instances`` emulated engines
(:mod:`benchmarks.emulator`, profile ``--profile``, default ``h100_llama8b``; each its own
processor, all sharing one local store, engine caches of ``--pages`` pages) and, per arm,
the router in front of them (:mod:`.fleet_runs`: round robin in the client, the peer
routers' cache-aware policies, ours, ours running a baseline policy (``*-nostore``: the
engines cache in their own pages only for that run, no store lookups or saves, as the
Mooncake paper's Figure 5 baselines without a global pool; ``kvcentric-router-nostore``:
Algorithm 1 so, over engine caches alone), ours over a P/D split:
``kvcentric-pd50``, ``-pd62``, ``-pd75`` and ``-pd81`` make the first half, 5/8, 3/4 or
13/16 of the instances prefill-only and the rest decode-only, each request's KV handed over
through the store, which the decode instances load beside their steps as the connector
does on a ``kv_consumer``; ``-syncload`` variants load inside the steps), caches emptied
before every run. In a P/D run TBT comes from the decode pool and
the hit shares from the prefill pool (a decode instance loading what its prefill just
computed is the hand-over, not reuse; ``pd_transfer_share`` is the share of the decode
pool's prompt tokens it loaded rather than recomputed). The workloads are
:mod:`kvcentric.bench_serving`'s at each offered rate: the Mooncake traces (their first
``--requests`` lines, times scaled to the rate, tokens by ``--scale-tokens``), hot prefix
(Zipf-popular prefixes, Poisson arrivals) and the coding agent (multi-turn sessions: a
shared system prompt, a long first turn, more context each turn, think time; a turn is
sent when the previous answer came; ``--requests`` worth of sessions, or more at high
rates: enough to arrive over :data:`AGENT_SPAN_SESSIONS` session lengths, since sessions
that have all arrived before the first one ends offer the engines their own pace, not the
rate). Each row's ``achieved_rps`` is the rate its counted requests arrived at, which
says whether the offered rate was the one served. Answers are cut to ``--max-output``
tokens (the token stream of every request goes through the router and the client on
this machine's CPUs).

Time: the emulation runs ``--dilation`` times slower than real time and every time is
reported back in emulated seconds (offered rates too), so the CPUs in front of the fleet
keep up. Each request's TBT is the mean of its longest 10% token gaps
(:func:`benchmarks.lib.capacity.paper_tbt`); hit shares come from the engines' own
per-request account (engine cache vs store).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.emulator.launch import EmulatorSpec
from benchmarks.emulator.profile import load as load_profile
from benchmarks.lib import capacity as cap
from benchmarks.lib.paths import LOGS
from benchmarks.serving.compare import OUR_ARMS, OUR_ROUTER, PEER_CACHE_AWARE, POLICY_ARMS
from benchmarks.serving.fleet import Arm
from benchmarks.serving.fleet_runs import FleetRun, FleetSetup, split_cpus, summary_row
from kvcentric.bench_serving.tokens import TokenSource
from kvcentric.bench_serving.trace import read_trace
from kvcentric.bench_serving.workloads import Turn, Workload, WorkloadSpec, build
from kvcentric.testing.models import build_model

# ours with the decision on TTFT alone (no charge for the decodes a colocated prefill
# stalls, nor for the request's own work: kvcentric.router.cost.decision), without the
# work charge alone, and without the load bound: what each part of the score does
ABLATIONS = [Arm(f"kvcentric-{name}", gateway="kvcentric",
                 gateway_opts={**OUR_ROUTER.gateway_opts, "extra": {"cost": cost}})
             for name, cost in (("ttft_only", {"stall_weight": 0.0, "work_weight": 0.0}),
                                ("nowork", {"work_weight": 0.0}),
                                ("nobound", {"balance_abs": None}),
                                ("landing", {"wait_for_landing": True}))]
# Figure 5's baselines have no global pool: each instance reuses its own cache only
LOCAL_ARMS = [replace(a, name=f"{a.name}-nostore", shared_store=False)
              for a in POLICY_ARMS if a.name != "kvcentric-round_robin"]
# Algorithm 1 over the engines' caches alone (what the store adds to it)
OUR_LOCAL = replace(OUR_ROUTER, name="kvcentric-router-nostore", shared_store=False)
# Mooncake's architecture: a prefill pool and a decode pool, each request's KV handed from
# one to the other through the store; ``pd`` is the prefill pool's share of the instances
PD_ARMS = [Arm(f"kvcentric-pd{round(100 * share)}", gateway="kvcentric",
               gateway_opts={**OUR_ROUTER.gateway_opts, "pd": share})
           for share in (0.5, 0.625, 0.75, 0.8125)]
# the decode instances loading inside their steps (connector async_loads: false)
PD_SYNC = [replace(a, name=f"{a.name}-syncload", sync_decode_loads=True) for a in PD_ARMS]
ARMS = {a.name: a for a in [Arm("round-robin"), *PEER_CACHE_AWARE, *OUR_ARMS, *POLICY_ARMS,
                            *ABLATIONS, *PD_ARMS, *PD_SYNC, *LOCAL_ARMS, OUR_LOCAL]}
DEFAULT_ARMS = ("round-robin", "vllm-router-cache_aware", "smg-cache_aware",
                "kvcentric-router", "kvcentric-admission")
OURS = tuple(a.name for a in [*OUR_ARMS, *PD_ARMS, *PD_SYNC, OUR_LOCAL])
PEERS = tuple(a.name for a in PEER_CACHE_AWARE)
# Figure 5's schedulers, each our router running that policy over the same fleet: random
# and load-balancing with engine caches only; local cache-aware, Algorithm 1's TTFT
# estimate from each instance's own cache and queue; global cache-aware, Algorithm 1 over
# engine caches and the store. (SGLang's engine_cache, whose match must cover half the
# prompt, routes this trace's prompts, which reuse far less, as least loaded does.)
FIGURE5 = ("kvcentric-random-nostore", "kvcentric-least_loaded-nostore",
           "kvcentric-router-nostore", "kvcentric-router")
# hot prefix and the coding agent, in tokens (a trace brings its own lengths)
HOT = {"groups": 16, "prefix": 8192, "question": 512}
AGENT = {"system": 20480, "first": 10240, "turn": 2048, "turns_mean": 12.0,
         "turns_std": 6.0, "think_s": 5.0}
# a coding agent's sessions arrive over at least this many mean session lengths (turns
# times think time): with fewer, every session has arrived before the first one ends, and
# the engines see the sessions' own pace, not the offered rate
AGENT_SPAN_SESSIONS = 3.0


def agent_sessions(requests: int, rate: float) -> int:
    """Sessions of the coding agent at ``rate`` requests/s (emulated): ``requests`` worth,
    or more, so that they arrive over :data:`AGENT_SPAN_SESSIONS` session lengths and the
    load holds at ``rate`` for most of the run."""
    turns = AGENT["turns_mean"]
    span_s = AGENT_SPAN_SESSIONS * turns * AGENT["think_s"]
    return max(1, round(requests / turns), math.ceil(rate / turns * span_s))


def capped(w: Workload, max_output: int) -> Workload:
    """``w`` with every answer at most ``max_output`` tokens."""
    return replace(w, sessions=[
        replace(s, turns=tuple(Turn(t.user, min(t.output_len, max_output), t.gap_s)
                               for t in s.turns)) for s in w.sessions])


def _s(x: float | None, d: float) -> float | None:
    """Wall seconds as emulated seconds, to the microsecond (None stays None)."""
    return None if x is None else round(x / d, 6)


def request_rows(arm: str, rate: float, rep: int, recs: list[dict[str, Any]],
                 outs: list[cap.Served], engine: list[dict[str, Any]], d: float,
                 warmup: int) -> list[dict[str, Any]]:
    """One row per request of a run, what explains its TTFT: as the client saw it (status,
    TTFT, TBT as the paper defines it), what our router predicted (``predicted_ttft_s``,
    its header; None for the peers), and where it ran (``engines``: the engines that
    served its ``x-request-id``, the prefill's first in a P/D split, with the first one's
    queueing, engine-cache and store hits and store-load time). ``recs``: the client's
    records in start order, the first ``warmup`` not counted, and ``outs`` what
    :meth:`FleetEngine.point` made of each (emulated TTFT and TBT). Times in emulated
    seconds."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for e in sorted(engine, key=lambda e: e["arrival"]):
        rid = e.get("request_id") or ""
        by_id.setdefault(rid.partition("/")[2], []).append(e)  # <arm>.<rep>/<sid>/<turn>
    rows = []
    for i, (r, o) in enumerate(zip(recs, outs, strict=True)):
        es = by_id.get(f"{r['sid']}/{r['turn']}", [])
        first = es[0] if es else {}
        admitted = first.get("admitted")
        rows.append({
            "arm": arm, "rate": rate, "rep": rep, "sid": r["sid"], "turn": r["turn"],
            "counted": i >= warmup, "start_s": _s(r["start_s"], d),
            "prompt_len": r["prompt_len"], "status": r["status"],
            "ttft_s": o.ttft_s, "tbt_s": o.tbt_s if o.ttft_s is not None else None,
            "predicted_ttft_s": _s(r.get("predicted_ttft_s"), d),
            "engines": [e["engine"] for e in es],
            "queue_s": (_s(admitted - first["arrival"], d) if admitted is not None
                        else None),
            "engine_hit": first.get("local_hit"), "store_hit": first.get("external_hit"),
            "load_s": _s(first.get("load_s"), d)})
    return rows


class FleetEngine:
    """One emulated fleet for a whole sweep; ``point`` runs one arm at one rate."""

    ours = OURS
    peers = PEERS
    figure5 = FIGURE5

    def __init__(self, args: argparse.Namespace, slo: cap.Slo) -> None:
        self.args = args
        self.slo = slo
        self.arms = args.arms.split(",") if args.arms else list(DEFAULT_ARMS)
        unknown = set(self.arms) - set(ARMS)
        if unknown:
            raise ValueError(f"unknown arms {sorted(unknown)}; known: {', '.join(ARMS)}")
        self.profile = load_profile(args.profile)
        self.d = args.dilation or max(1.0, args.instances / 16)
        # the emulator's context: what one engine's cache holds, at most (see its server)
        self.max_len = min(args.max_model_len, args.pages * self.profile.page_size)
        model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
        self.src = TokenSource(model)
        emu_cpus, self.rest = split_cpus()
        self.emu = EmulatorSpec(instances=args.instances, tokenizer=model,
                                profile=args.profile, pages=args.pages,
                                max_model_len=self.max_len, cpus=emu_cpus,
                                dilation=self.d)
        self.logs = LOGS / f"slo_capacity-{time.strftime('%Y%m%d-%H%M%S')}"
        endpoint = "chat" if args.workload == "agentic" else "completions"
        self.fr = FleetRun(FleetSetup(self.emu, slo.ttft_s * 1e3, slo.tbt_s * 1e3,
                                      endpoint=endpoint, router_cpus=self.rest), self.logs)
        self._w: dict[tuple[float, int], Workload] = {}
        self.runs: list[dict[str, Any]] = []
        self.request_log: list[dict[str, Any]] = []  # every run's requests (request_rows)

    def __enter__(self) -> FleetEngine:
        if self.rest:
            os.sched_setaffinity(0, self.rest)  # the client with the routers
        self.fr.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.fr.__exit__(*exc)

    @staticmethod
    def baseline(arm: str) -> bool:
        return arm not in OURS

    # ---- the workload at an offered rate (emulated requests per second) ----
    def spec(self, rate: float, rep: int) -> WorkloadSpec:
        a, d, seed = self.args, self.d, self.args.seed + rep
        wall = rate / d
        if a.workload in ("conversation", "synthetic"):
            path = a.trace_dir / f"{a.workload}_trace.jsonl"
            recs = read_trace(path, a.requests)
            span_s = (recs[-1].timestamp_ms - recs[0].timestamp_ms) / 1e3
            if len(recs) < 2 or span_s <= 0:
                raise ValueError(f"{path}: needs two requests at different times")
            return WorkloadSpec(workload="trace", seed=seed, trace=str(path),
                                max_requests=a.requests, scale_tokens=a.scale_tokens,
                                max_input_len=self.max_len - a.max_output - 16,
                                time_scale=(len(recs) - 1) / (wall * span_s))
        s = a.scale_tokens
        if a.workload == "hotprefix":
            return WorkloadSpec(workload="shared-prefix", seed=seed, num_groups=HOT["groups"],
                                prompts_per_group=max(1, a.requests // HOT["groups"]),
                                shared_system_prompt_len=round(HOT["prefix"] * s),
                                turn_input_len=max(1, round(HOT["question"] * s)),
                                output_len=a.max_output, group_skew=1.0, request_rate=wall)
        turns = AGENT["turns_mean"]
        return WorkloadSpec(workload="multi-turn", seed=seed,
                            num_users=agent_sessions(a.requests, rate), turns_mean=turns,
                            turns_std=AGENT["turns_std"],
                            shared_system_prompt_len=round(AGENT["system"] * s),
                            user_context_len=round(AGENT["first"] * s),
                            turn_input_len=round(AGENT["turn"] * s), output_len=a.max_output,
                            turn_gap=AGENT["think_s"] * d, user_rate=wall / turns)

    def workload(self, rate: float, rep: int) -> Workload:
        key = (rate, rep)
        if key not in self._w:
            self._w = {key: capped(build(self.spec(rate, rep), self.src), self.args.max_output)}
        return self._w[key]

    def nominal_rps(self) -> float:
        """Instances over one uncached prefill of the mean prompt, alone (emulated)."""
        w = self.workload(1.0, 0)
        n = statistics.fmean(len(s.system) + sum(len(t.user) for t in s.turns[:1])
                             for s in w.sessions)
        return self.args.instances / self.profile.prefill_alone_s(round(n))

    # ---- one run ----
    def point(self, arm: str, rate: float, rep: int
              ) -> tuple[dict[str, Any], list[cap.Served]]:
        share = ARMS[arm].gateway_opts.get("pd")
        if share:
            res = self.fr.run_pd(ARMS[arm], self.workload(rate, rep), self.src, rep,
                                 min(self.args.instances - 1,
                                     max(1, round(share * self.args.instances))))
        else:
            res = self.fr.run_arm(ARMS[arm], self.workload(rate, rep), self.src, rep)
        d = self.d
        recs = sorted(res["requests"], key=lambda r: r["start_s"])
        outs = [cap.Served(r["ttft_s"] / d if r["success"] else None,
                           cap.paper_tbt([x / d for x in r["itl_s"]]), r["prompt_len"],
                           rejected=r["status"] == 429) for r in recs]
        kept = cap.counted(outs, self.args.warmup)
        row = cap.rate_point(kept, self.slo, rate, len(kept) / rate)
        # the rate the counted requests arrived at (emulated): the offered rate unless a
        # workload's own pace (sessions' turns) held it back
        first = recs[len(outs) - len(kept)]["start_s"] if kept else 0.0
        span = (recs[-1]["start_s"] - first) / d if kept else 0.0
        row["achieved_rps"] = (len(kept) - 1) / span if span > 0 else None
        engine = res["engine_requests"]
        prefill = set(res.get("prefill_engines", ()))
        # a P/D split: tokens come from the decode pool, the prompt's reuse is the prefill's
        decode = [r for r in engine if r["engine"] not in prefill]
        row |= self.tbt_sources(kept, decode, self.args.instances - len(prefill))
        row["pd_transfer_share"] = None
        if prefill:
            # what the decode pool loaded of its prompts (the hand-over) and did not recompute
            row["pd_transfer_share"] = (res["server_metrics"]["pd_transfer_tokens"]
                                        / (sum(r["prompt_tokens"] for r in decode) or 1))
            engine = [r for r in engine if r["engine"] in prefill]
        prompt = sum(r["prompt_tokens"] for r in engine) or 1
        local = sum(r["local_hit"] for r in engine)
        external = sum(r["external_hit"] for r in engine)
        fleet = summary_row(res)
        row |= {"engine_hit_share": local / prompt, "store_hit_share": external / prompt,
                "miss_share": 1 - (local + external) / prompt,
                "router_added_p50_ms": fleet["router_added_p50_ms"],
                "router_cpu_ms_per_request": fleet["router_cpu_ms_per_request"],
                "emulator_loop_lag_max_s": fleet["emulator_loop_lag_max_s"],
                "wall_s": res["wall_s"]}
        self.runs.append({"arm": arm, "rate": rate, "rep": rep, **fleet})
        self.request_log.extend(request_rows(arm, rate, rep, recs, outs,
                                             res["engine_requests"], d, len(outs) - len(kept)))
        print(f"  {arm} at {rate:.3g}/s (rep {rep}): effective "
              f"{row['effective_fraction']:.2f}, TTFT mean {row['ttft_mean_s'] or 0:.2f} s",
              flush=True)
        return row, kept

    def tbt_sources(self, kept: list[cap.Served], engine: list[dict[str, Any]],
                    engines: int) -> dict[str, Any]:
        """Where TBT misses arise: the share of counted requests over the TBT SLO as the
        client saw their tokens (``tbt_miss_share``) and as their engine emitted them
        (``engine_tbt_miss_share``: the engine's steps, i.e. placement; the difference is
        the router's relay and the client), and how unevenly the engines were loaded
        (``engine_requests_max_over_mean``, over ``engines`` engines: those that emit
        tokens). Engine records are counted without the same warm-up share, by arrival."""
        d, slo = self.d, self.slo.tbt_s
        served = [o for o in kept if o.ttft_s is not None]
        recs = sorted(engine, key=lambda r: r["arrival"])
        recs = recs[round(self.args.warmup * len(recs)):]
        tbt = [r["tbt_s"] / d for r in recs]
        per: dict[str, int] = {}
        for r in recs:
            per[r["engine"]] = per.get(r["engine"], 0) + 1
        counts = [*per.values(), *[0] * max(0, engines - len(per))]
        mean = statistics.fmean(counts) if counts else 0.0
        return {"tbt_miss_share": (sum(o.tbt_s > slo for o in served) / len(served)
                                   if served else None),
                "engine_tbt_miss_share": (sum(t > slo for t in tbt) / len(tbt)
                                          if tbt else None),
                "engine_tbt_p90_s": float(np.percentile(tbt, 90)) if tbt else None,
                "engine_requests_max_over_mean": max(counts) / mean if mean else None}

    def info(self) -> dict[str, Any]:
        a = self.args
        return {"title": f"{a.instances} emulated instances ({a.profile})",
                "summary": {"profile": a.profile, "dilation": self.d,
                            "requests_per_point": self.workload(1.0, 0).num_requests},
                "config": {"emulator": {k: v for k, v in self.emu.__dict__.items()
                                        if k != "tokenizer"},
                           "profile": self.profile.to_json(), "max_output": a.max_output,
                           "scale_tokens": a.scale_tokens, "store": "one local store, all arms"},
                "notes": ["Engine: benchmarks.emulator engines (vLLM's scheduler and prefix "
                          f"cache, profile {a.profile}), real routers in front; logs in "
                          f"{self.logs}.",
                          f"Answers cut to {a.max_output} tokens; emulation dilated "
                          f"x{self.d:g}, times and rates reported in emulated time."]}
