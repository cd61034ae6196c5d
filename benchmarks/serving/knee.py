"""How do reuse and TTFT p90 change with the engine's KV capacity, with and without the store?

Capacity knee (issue 17 part 1): reuse and TTFT p90 vs the engine's KV capacity, for
vLLM alone, + the kvcentric local store (DRAM), + a DRAM-limited store with a disk tier.

    python -m benchmarks.serving.knee [--quick] [--out benchmarks/results/knee.json]

Workload (controlled multi-turn, token-id prompts on ``/v1/completions``): ``sessions``
users, each with a private document of ``doc_len`` tokens and ``turns`` measured turns of
``turn_input_len`` new tokens and a greedy answer of ``output_len`` tokens; every turn
resends the session's whole history (cumulative per-session prefix, no shared system
prompt). Before the timed run each document is served once, one at a time (the warm-up,
not measured, outside the ``/metrics`` deltas), so every measured turn has a reusable
prefix. The timed run is closed loop at ``concurrency`` requests in flight; sessions wait
in FIFO order for a slot, so they advance round robin and a session's next turn comes
after every other session's turn: the engine keeps a session's prefix only if it holds
all sessions' contexts at once. Per session the working set is ``W = 1 (BOS) + doc_len +
turns * (turn_input_len + output_len)`` tokens (:meth:`KneePlan.session_tokens`); all
sessions together ``sessions * W`` (:meth:`KneePlan.working_set_tokens`). The reuse ceiling
(:meth:`KneePlan.reuse_ceiling`) is the share of measured prompt tokens whose full
128-token blocks an infinite cache already holds from the previous turn's prompt (answers
are re-tokenised by the client, so their blocks are not counted: the ceiling is a lower
bound of what a perfect cache could reach).

Sweep: engine KV capacities (``--num-gpu-blocks-override``) of ``fractions`` of the working
set, in whole 128-token vLLM CPU blocks. At each capacity, one vLLM CPU instance (``bench``
model, bfloat16, worker threads pinned alike) is started fresh for each arm:

- ``vllm-alone``: no connector, vLLM's own prefix cache only;
- ``kvcentric-dram``: our connector over a local store holding the whole workload in DRAM;
- ``kvcentric-disk``: our connector over a local store whose DRAM holds ``disk_dram_fraction``
  of the working set's KV, with a disk tier (a temp folder) holding all of it.

Per point, from the servers' ``/metrics`` deltas over the timed run: engine hit ratio
(``vllm:prefix_cache_hits`` / ``_queries``), store hit ratio (``vllm:external_prefix_cache_
hits`` / ``_queries``), reuse (engine + store hit tokens / prompt tokens); from the client:
TTFT p50/p90, E2E p90, completed requests.

Knee (:func:`knee_capacity`): the smallest swept capacity where vLLM alone's engine hit
ratio reaches 90% of its maximum over the sweep. "Above the knee" means every swept
capacity at or above it; vLLM alone's TTFT p90 there is the median over those points.
Summary keys: ``alone_p90_at_min_over_above_knee`` and ``store_p90_at_min_over_above_knee``
(TTFT p90 at the smallest capacity, vLLM alone and with the DRAM store, each over vLLM
alone above the knee; ``disk_p90_at_min_over_above_knee`` likewise for the disk arm).
Target: the store's ratio <= 2 while vLLM alone's is >= 5 (``target_met``).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS
from benchmarks.serving.fleet import (
    CPU_PAGE,
    SERVED_NAME,
    SERVER_ARGS,
    Arm,
    FleetSpec,
    engine_cache_args,
    fleet,
    pinned_threads_env,
)
from kvcentric.bench_serving.client import Api
from kvcentric.bench_serving.loadgen import benchmark
from kvcentric.bench_serving.runner import RunConfig
from kvcentric.bench_serving.tokens import TokenSource
from kvcentric.bench_serving.workloads import Session, Turn, Workload, WorkloadSpec, build
from kvcentric.store import open_store
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import connector_config

ARMS = ("vllm-alone", "kvcentric-dram", "kvcentric-disk")
ALONE, STORE, DISK = ARMS
KNEE_SHARE = 0.9  # the knee: vLLM alone's engine hit ratio reaches this share of its max
DTYPE = "bfloat16"
DTYPE_BYTES = 2
# the store's own counters (warm-up and timed run), kept per point: where hits came from
STORE_STATS = ("evictions", "dram_hits", "disk_hits", "demotions", "promotions",
               "dropped_undemoted", "disk_evictions")


@dataclass(frozen=True)
class KneePlan:
    """The workload and the sweep; ``ValueError`` on values that cannot make a sweep."""

    sessions: int
    turns: int
    doc_len: int
    turn_input_len: int
    output_len: int
    concurrency: int
    fractions: tuple[float, ...]
    disk_dram_fraction: float = 0.25
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.sessions, self.turns, self.doc_len, self.turn_input_len,
               self.output_len, self.concurrency) < 1:
            raise ValueError("sessions, turns, lengths and concurrency must be >= 1")
        if len(self.fractions) < 2 or min(self.fractions) <= 0:
            raise ValueError("need >= 2 capacity fractions, all > 0")
        if not 0 < self.disk_dram_fraction <= 1:
            raise ValueError("disk_dram_fraction must be in (0, 1]")

    def prompt_lens(self) -> list[int]:
        """Planned prompt tokens of measured turns 0..turns-1 (BOS included)."""
        step = self.turn_input_len + self.output_len
        return [1 + self.doc_len + self.turn_input_len + k * step for k in range(self.turns)]

    def session_tokens(self) -> int:
        """W: one session's final context (last prompt + last answer), in tokens."""
        return self.prompt_lens()[-1] + self.output_len

    def working_set_tokens(self) -> int:
        """All sessions' contexts together: what the engine must hold for full reuse."""
        return self.sessions * self.session_tokens()

    def reuse_ceiling(self) -> float:
        """Share of measured prompt tokens an infinite cache can serve: per turn, the full
        blocks of the previous prompt (the warm-up document for turn 0), at most len - 1."""
        lens = self.prompt_lens()
        prev = [1 + self.doc_len, *lens[:-1]]
        hit = sum(min(p, n - 1) // CPU_PAGE * CPU_PAGE for p, n in zip(prev, lens))
        return hit / sum(lens)

    def capacities(self) -> list[int]:
        """Engine KV capacities (tokens, ``--num-gpu-blocks-override`` x 128): each fraction
        of the working set, in whole blocks, at least ``max_model_len`` plus vLLM's null
        block (vLLM refuses to start with less); sorted, duplicates dropped."""
        ws, floor = self.working_set_tokens(), self.max_model_len() + CPU_PAGE
        caps = {max(floor, round(f * ws / CPU_PAGE) * CPU_PAGE) for f in self.fractions}
        return sorted(caps)

    def max_model_len(self) -> int:
        """The servers' context: the session's final context, rounded up to a block."""
        return math.ceil(self.session_tokens() / CPU_PAGE) * CPU_PAGE


QUICK = KneePlan(sessions=6, turns=3, doc_len=1024, turn_input_len=128, output_len=8,
                 concurrency=2, fractions=(0.25, 0.5, 0.75, 1.0, 1.25, 1.75))
FULL = KneePlan(sessions=8, turns=4, doc_len=1536, turn_input_len=192, output_len=16,
                concurrency=2, fractions=(0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0))


# --------------------------------------------------------------------------- workload

def workloads(plan: KneePlan, src: TokenSource) -> tuple[Workload, Workload]:
    """(warm-up, timed): the multi-turn workload of :mod:`kvcentric.bench_serving.workloads`
    (no system prompt, the document in the first turn), and each session's document alone
    as a one-turn, one-token session."""
    spec = WorkloadSpec(workload="multi-turn", seed=plan.seed, num_users=plan.sessions,
                        turns_mean=plan.turns, turns_std=0.0, shared_system_prompt_len=0,
                        user_context_len=plan.doc_len, turn_input_len=plan.turn_input_len,
                        output_len=plan.output_len, user_rate=None, turn_gap=0.0)
    timed = build(spec, src)
    warm = [Session(f"warm-{s.sid}", 0.0, (Turn(s.turns[0].user[:plan.doc_len], 1),))
            for s in timed.sessions]
    return Workload("knee-warmup", warm), timed


def kv_bytes_per_token(model: str) -> int:
    """K and V bytes of one token over all layers, for the model folder's config."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * DTYPE_BYTES


def arm_for(name: str, plan: KneePlan, kv_token_bytes: int, scratch: Path) -> Arm:
    """A fresh arm ``name`` (a new store, never shared with another point)."""
    if name == ALONE:
        return Arm(ALONE)
    ws_bytes = plan.working_set_tokens() * kv_token_bytes
    store: dict[str, Any] = {"name": f"knee-{uuid.uuid4().hex[:8]}",
                             "capacity": max(64 << 20, 2 * ws_bytes)}
    if name == DISK:
        store["capacity"] = max(4 << 20, int(plan.disk_dram_fraction * ws_bytes))
        store["disk"] = {"path": str(scratch / store["name"]),
                         "capacity": max(256 << 20, 4 * ws_bytes)}
    elif name != STORE:
        raise ValueError(f"unknown arm {name!r}; known: {ARMS}")
    return Arm(name, connector_config(store), store)


# ------------------------------------------------------------------------------ points

def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def point_row(capacity: int, arm: str, plan: KneePlan, res: dict[str, Any]) -> dict[str, Any]:
    """One table row from a :func:`benchmarks.serving.loadgen.benchmark` result."""
    t, s = res["server_metrics"]["total"], res["summary"]
    local = t.get("vllm:prefix_cache_hits_total")
    ext = t.get("vllm:external_prefix_cache_hits_total")
    queries = t.get("vllm:prefix_cache_queries_total")
    hits = (local or 0.0) + (ext or 0.0) if local is not None else None
    return {"capacity_tokens": capacity, "capacity_blocks": capacity // CPU_PAGE,
            "fraction_of_working_set": capacity / plan.working_set_tokens(), "arm": arm,
            "status": "ok", "engine_hit_ratio": ratio(local, queries),
            "store_hit_ratio": ratio(ext, t.get("vllm:external_prefix_cache_queries_total")),
            "reuse": ratio(hits, queries), "ttft_p50_ms": s["ttft_p50_ms"],
            "ttft_p90_ms": s["ttft_p90_ms"], "e2e_p90_ms": s["e2e_p90_ms"],
            "completed": s["completed"], "requests": s["num_requests"],
            "failed": s["failed"], "duration_s": s["duration_s"],
            **{f"store_{k}": v for k, v in (res.get("store_stats") or {}).items()
               if k in STORE_STATS}}


def run_point(plan: KneePlan, arm: Arm, capacity: int, model: str, src: TokenSource,
              warm: Workload, timed: Workload, logs: Path) -> dict[str, Any]:
    """Start one instance for ``arm`` at ``capacity``, serve the warm-up one request at a
    time, then the timed run at ``plan.concurrency``; the timed run's result document."""
    fspec = FleetSpec(model, instances=1, dtype=DTYPE, max_model_len=plan.max_model_len(),
                      env=pinned_threads_env(),
                      args=(*SERVER_ARGS, *engine_cache_args(capacity)))
    (logs / f"cap{capacity}").mkdir(parents=True, exist_ok=True)
    with fleet(fspec, arm, logs / f"cap{capacity}") as servers:
        urls = (servers[0].url,)
        api = Api(SERVED_NAME, "completions")
        benchmark(src, warm, RunConfig(urls, api, "ids", max_concurrency=1),
                  progress=False, sample_interval_s=0)
        res = benchmark(src, timed, RunConfig(urls, api, "ids",
                                              max_concurrency=plan.concurrency),
                        label=f"{arm.name}@{capacity}", progress=False, sample_interval_s=0)
        if arm.store is not None:
            with open_store(arm.store) as st:
                res["store_stats"] = st.stats()
        return res


def sweep(plan: KneePlan, arms: Sequence[str], model: str, logs: Path) -> list[dict[str, Any]]:
    """Every (capacity, arm) point, capacities ascending; a point that fails is a row
    with ``status`` saying why (never made-up numbers)."""
    src = TokenSource(model)
    warm, timed = workloads(plan, src)
    kv_token = kv_bytes_per_token(model)
    scratch = Path(tempfile.mkdtemp(prefix="kvc-knee-disk-"))
    rows: list[dict[str, Any]] = []
    points = [(c, a) for c in plan.capacities() for a in arms]
    try:
        with tqdm(points, desc="knee points", unit="pt") as bar:
            for cap, name in bar:
                bar.set_postfix_str(f"{name} @ {cap} tokens")
                rows.append(_one(plan, name, cap, model, src, warm, timed, kv_token,
                                 scratch, logs))
                last = rows[-1].get("ttft_p90_ms")
                tqdm.write(f"{name:>15} @ {cap:6d} tokens: " + (
                    f"TTFT p90 {last:.0f} ms, reuse {rows[-1]['reuse']}" if last is not None
                    else rows[-1]["status"]))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


def _one(plan: KneePlan, name: str, cap: int, model: str, src: TokenSource, warm: Workload,
         timed: Workload, kv_token: int, scratch: Path, logs: Path) -> dict[str, Any]:
    arm = arm_for(name, plan, kv_token, scratch)
    try:
        res = run_point(plan, arm, cap, model, src, warm, timed, logs)
    except Exception as e:  # noqa: BLE001 (a point that cannot run is reported, not fatal)
        return {"capacity_tokens": cap, "arm": name, "status": f"failed: {type(e).__name__}: "
                f"{str(e)[:300]}"}
    finally:
        if arm.store and "disk" in arm.store:
            shutil.rmtree(arm.store["disk"]["path"], ignore_errors=True)
    return point_row(cap, name, plan, res)


# ----------------------------------------------------------------------------- summary

def knee_capacity(curve: Sequence[tuple[int, float | None]],
                  share: float = KNEE_SHARE) -> int | None:
    """The smallest capacity whose hit ratio is >= ``share`` of the curve's maximum
    (``curve``: (capacity, hit ratio) pairs, any order; None ratios are skipped). None
    when no point has a positive ratio."""
    pts = [(c, r) for c, r in curve if r is not None]
    best = max((r for _, r in pts), default=0.0)
    if best <= 0:
        return None
    return min(c for c, r in pts if r >= share * best)


def _by_arm(rows: Sequence[dict[str, Any]], arm: str, key: str) -> dict[int, Any]:
    return {r["capacity_tokens"]: r.get(key) for r in rows
            if r["arm"] == arm and r.get("status") == "ok"}


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The knee and the summary ratios (module docstring); None where a point is missing."""
    knee = knee_capacity(list(_by_arm(rows, ALONE, "engine_hit_ratio").items()))
    alone = _by_arm(rows, ALONE, "ttft_p90_ms")
    above = [v for c, v in alone.items() if knee is not None and c >= knee and v is not None]
    ref = statistics.median(above) if above else None
    smallest = min((r["capacity_tokens"] for r in rows), default=None)
    out: dict[str, Any] = {"knee_capacity_tokens": knee, "smallest_capacity_tokens": smallest,
                           "alone_p90_above_knee_ms": ref}
    for arm, key in ((ALONE, "alone"), (STORE, "store"), (DISK, "disk")):
        at_min = _by_arm(rows, arm, "ttft_p90_ms").get(smallest) if smallest else None
        out[f"{key}_p90_at_min_ms"] = at_min
        out[f"{key}_p90_at_min_over_above_knee"] = ratio(at_min, ref)
    a, s = out["alone_p90_at_min_over_above_knee"], out["store_p90_at_min_over_above_knee"]
    out["target_met"] = a is not None and s is not None and a >= 5 and s <= 2
    return out


# ---------------------------------------------------------------------------- outputs

def draw(doc: dict[str, Any], path: Path) -> None:
    """Reuse (left) and TTFT p90 (right, log) vs capacity, one line per arm; the knee as a
    dotted line, the reuse ceiling and working set as grey dashes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, ws = doc["points"], doc["workload"]["working_set_tokens"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.4))
    for arm, marker in zip(ARMS, "os^"):
        for ax, key in ((a1, "reuse"), (a2, "ttft_p90_ms")):
            pts = sorted(_by_arm(rows, arm, key).items())
            pts = [(c, v) for c, v in pts if v is not None]
            if pts:
                ax.plot([c for c, _ in pts], [v for _, v in pts], marker + "-", label=arm)
    a1.axhline(doc["workload"]["reuse_ceiling"], color="grey", ls="--", lw=1,
               label="reuse ceiling (planned)")
    knee = doc["summary"]["knee_capacity_tokens"]
    for ax in (a1, a2):
        ax.axvline(ws, color="grey", ls="-.", lw=1, label="working set")
        if knee is not None:
            ax.axvline(knee, color="black", ls=":", lw=1.5, label=f"knee ({knee} tokens)")
        ax.set_xlabel("engine KV capacity (tokens)")
        ax.grid(alpha=0.3)
    a1.set(ylabel="reuse: hit tokens / prompt tokens", ylim=(0, 1),
           title="realised reuse (engine + store)")
    a2.set(ylabel="TTFT p90 (ms)", yscale="log", title="TTFT p90")
    a1.legend(fontsize=8, loc="lower right")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(doc: dict[str, Any]) -> str:
    cols = ("capacity_tokens", "arm", "engine_hit_ratio", "store_hit_ratio", "reuse",
            "ttft_p50_ms", "ttft_p90_ms", "e2e_p90_ms", "completed", "status")
    lines = [" | ".join(cols)]
    for r in doc["points"]:
        vals = (r.get(c) for c in cols)
        lines.append(" | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in vals))
    lines += [f"{k}: {v}" for k, v in doc["summary"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sessions, 6 capacities")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"subset of {','.join(ARMS)}")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    if unknown := set(arms) - set(ARMS):
        ap.error(f"unknown arms {sorted(unknown)}")
    plan = QUICK if args.quick else FULL
    model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    logs = Path(tempfile.mkdtemp(prefix="kvc-knee-logs-"))
    print(f"working set {plan.working_set_tokens()} tokens, capacities "
          f"{plan.capacities()}; logs in {logs}")
    t0 = time.monotonic()
    rows = sweep(plan, arms, model, logs)
    if not any(r["status"] == "ok" for r in rows):
        print("no point ran; nothing written:", *(r["status"] for r in rows), sep="\n")
        return 1
    doc: dict[str, Any] = {
        "title": "Capacity knee: reuse and TTFT p90 vs engine KV capacity",
        "quick": args.quick, "model": "bench", "dtype": DTYPE,
        "workload": {**asdict(plan), "session_tokens": plan.session_tokens(),
                 "working_set_tokens": plan.working_set_tokens(),
                 "reuse_ceiling": plan.reuse_ceiling(), "max_model_len": plan.max_model_len(),
                 "capacities": plan.capacities(), "threads_env": pinned_threads_env()},
        "points": rows, "summary": summarize(rows), "wall_s": time.monotonic() - t0}
    out = args.out or RESULTS / ("knee_quick.json" if args.quick else "knee.json")
    rw.write(out, doc, table=table(doc),
             figures=[rw.Figure("knee", "Reuse and TTFT p90 vs engine KV capacity",
                                lambda p: draw(doc, p))],
             command=rw.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
