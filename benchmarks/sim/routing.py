"""Which routing policy serves a Mooncake trace best on a simulated P/D cluster?

Replay a Mooncake trace through a simulated P/D cluster under each routing policy.

    python -m benchmarks.sim.routing --trace TRACE.jsonl \\
        [--quick] [--out FILE.json] [--prefill 4 --decode 4 ...]

``TRACE.jsonl``: one of Mooncake's FAST'25 traces (``FAST25-release/traces/`` of
github.com/kvcache-ai/Mooncake: ``conversation_trace.jsonl``, ``synthetic_trace.jsonl``).

Every policy replays the same requests on the same cluster model (``benchmarks.sim.cluster``):
same instances, same per-instance cache capacity, same store capacity and bandwidth, same
prefill profile and the same noise on real prefill times. Each arm runs one of the router's
own policies (:mod:`kvcentric.router.policies`, named in :data:`benchmarks.sim.cluster.ARMS`)
on the router's view of the cluster:

- ``random``, ``round_robin``, ``least_load`` (the router's ``least_loaded``: least
  predicted prefill queue): with the global store (any instance can load any stored
  prefix), routing blind to where KV lives;
- ``local_cache_aware``: the router's ``engine_cache`` (SGLang-router-style cache-aware
  routing over per-instance caches only) with no global store; to keep total capacity
  equal each instance gets the store's share as private cache, and hits in it are free
  (generous to this baseline);
- ``kvcentric``: the router's ``algorithm1`` (Mooncake's Algorithm 1: queue + load from
  the store + prefill on the uncached part, and the decoder) with the global store,
  refusing requests predicted to miss the SLO;
- ``kvcentric_noreject``: the same choice without refusing, to show what comes from the
  placement alone; ``kvcentric_noreject_landing``: that with landings (a request may be
  held for a prefix an in-flight prefill is about to store: ``cost.wait_for_landing``);
- ``random_nostore``, ``round_robin_nostore``, ``least_load_nostore``: the blind ones
  without the store (the Mooncake paper's Figure 5 baselines), and ``engine_cache_store``:
  the cache-aware router over engine caches in front of the store
  (:mod:`benchmarks.serving.slo_capacity` sweeps them all to saturation).

Output: a table, JSON (summary ``ttft_mean_by_policy``, ``hit_rate_by_policy``,
``slo_attainment_by_policy``) and a PNG next to the JSON. Default model: an 8B-class GQA
model (128 KiB KV per token), prefill ~12k tokens/s with a quadratic attention term, a
25 GB/s store tier, 320-block (20 GiB) HBM prefix caches, a 16k-block (1 TiB) store.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS
from benchmarks.sim.cluster import ARMS, Cluster, Outcome, SimConfig
from benchmarks.sim.workloads import read_trace

POLICIES = tuple(ARMS)


def summarise(outs: list[Outcome], total: int) -> dict[str, Any]:
    served = [o for o in outs if o.ttft is not None]
    ttft = np.array([o.ttft for o in served]) if served else np.array([np.nan])
    tokens = sum(o.n for o in served) or 1
    return {"requests": total, "served": len(served), "rejected": total - len(served),
            "ttft_mean_s": float(ttft.mean()), "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p90_s": float(np.percentile(ttft, 90)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tbt_mean_ms": 1000 * statistics.fmean(o.tbt for o in served) if served else 0.0,
            "hit_rate": sum(o.hit_tokens for o in served) / tokens,
            "local_hit_rate": sum(o.local_tokens for o in served) / tokens,
            "slo_attainment": sum(o.met for o in outs) / total}


def table(res: dict[str, dict[str, Any]]) -> str:
    head = (f"{'policy':<19} {'mean TTFT':>9} {'p90':>8} {'p99':>8} {'hit rate':>8} "
            f"{'local':>6} {'SLO att.':>8} {'rejected':>8}")
    lines = [head, "-" * len(head)]
    for pol, r in res.items():
        lines.append(f"{pol:<19} {r['ttft_mean_s']:>8.2f}s {r['ttft_p90_s']:>7.2f}s "
                     f"{r['ttft_p99_s']:>7.2f}s {r['hit_rate']:>8.1%} {r['local_hit_rate']:>6.1%} "
                     f"{r['slo_attainment']:>8.1%} {r['rejected']:>8}")
    return "\n".join(lines)


def plot(res: dict[str, dict[str, Any]], ttfts: dict[str, list[float]], title: str,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pols = list(res)
    fig, ax = plt.subplots(1, 4, figsize=(18, 4.2))
    colors = ["#bbbbbb", "#999999", "#777777", "#4c72b0", "#dd8452", "#f0b27a"]
    for k, (key, label) in enumerate((("ttft_mean_s", "mean TTFT (s)"),
                                      ("slo_attainment", "SLO attainment"),
                                      ("hit_rate", "KV hit rate (tokens)"))):
        ax[k].bar(range(len(pols)), [res[p][key] for p in pols], color=colors[:len(pols)])
        ax[k].set_xticks(range(len(pols)), pols, rotation=35, ha="right", fontsize=8)
        ax[k].set_title(label)
    for p, c in zip(pols, colors):
        xs = np.sort(np.asarray(ttfts[p])) if ttfts[p] else np.array([0.0])
        ax[3].plot(xs, np.linspace(0, 1, len(xs)), label=p, color=c)
    ax[3].set_xscale("log")
    ax[3].set_xlabel("TTFT (s)")
    ax[3].set_title("TTFT CDF (served)")
    ax[3].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def kvcentric_wins(res: dict[str, dict[str, Any]]) -> dict[str, bool] | None:
    """Whether ``kvcentric`` beats every baseline on mean TTFT and on SLO attainment."""
    others = [p for p in res if not p.startswith("kvcentric")]
    if "kvcentric" not in res or not others:
        return None
    k = res["kvcentric"]
    return {"ttft_mean": all(k["ttft_mean_s"] < res[p]["ttft_mean_s"] for p in others),
            "slo_attainment": all(k["slo_attainment"] > res[p]["slo_attainment"]
                                  for p in others)}


def _config(args: argparse.Namespace) -> SimConfig:
    over: dict[str, Any] = {}
    if args.profile:  # a fitted router profile (``kvcentric-router profile``)
        prof = json.loads(Path(args.profile).read_text())
        over |= {"a": prof["a"], "b": prof["b"], "c": prof["c"],
                 "tbt_base": prof["tbt_base_s"], "tbt_per_seq": prof["tbt_per_seq_s"]}
    over |= {f.name: getattr(args, f.name) for f in fields(SimConfig)
             if getattr(args, f.name, None) is not None}
    return SimConfig(**over)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="the first 2000 requests only")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--profile", default=None,
                    help="router profile JSON: its prefill fit and TBT model replace a, b, c, "
                         "tbt_base, tbt_per_seq")
    for f in fields(SimConfig):
        ap.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=type(f.default),
                        default=None, help=f"default {f.default}")
    args = ap.parse_args(argv)
    cfg = _config(args)
    limit = args.limit or (2000 if args.quick else None)
    reqs = read_trace(args.trace, limit)
    stem = args.trace.stem.replace("_trace", "")
    out = args.out or RESULTS / f"sim_{stem}{'_quick' if args.quick else ''}.json"
    pols = [p for p in args.policies.split(",") if p]
    unknown = set(pols) - set(POLICIES)
    if unknown:
        ap.error(f"unknown policies {sorted(unknown)}; known: {POLICIES}")
    res: dict[str, dict[str, Any]] = {}
    ttfts: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for pol in tqdm(pols, desc=f"policies ({len(reqs)} requests)"):
        outs = Cluster(cfg, pol).run(reqs)
        res[pol] = summarise(outs, len(reqs))
        ttfts[pol] = [o.ttft for o in outs if o.ttft is not None]
    wall = time.perf_counter() - t0
    print(f"\n{args.trace.name}: {len(reqs)} requests, {cfg.prefill}P+{cfg.decode}D, "
          f"SLO TTFT {cfg.slo_ttft}s TBT {cfg.slo_tbt * 1000:.0f}ms ({wall:.1f}s)")
    print(table(res))
    wins = kvcentric_wins(res)
    if wins is not None:
        print(f"kvcentric beats every baseline: {wins}")
    summary = {"ttft_mean_by_policy": {p: r["ttft_mean_s"] for p, r in res.items()},
               "hit_rate_by_policy": {p: r["hit_rate"] for p, r in res.items()},
               "slo_attainment_by_policy": {p: r["slo_attainment"] for p, r in res.items()},
               "rejected_by_policy": {p: r["rejected"] for p, r in res.items()},
               "kvcentric_wins": wins}
    rw.write(out, {"trace": str(args.trace.name), "requests": len(reqs), "quick": args.quick,
                   "wall_s": wall, "config": asdict(cfg), "summary": summary, "policies": res},
             command=rw.command_line(__file__, argv))
    png = out.with_suffix(".png")
    plot(res, ttfts, f"{args.trace.name}: {len(reqs)} requests, {cfg.prefill}P+{cfg.decode}D",
         png)
    print(f"-> {out}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
