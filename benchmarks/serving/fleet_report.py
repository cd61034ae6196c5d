"""A fleet result's arms: medians and ranges, table, figure, per-request account.

Medians over repetitions with their range, the table, the figure, and the per-request
account of where our router sent each request and what it found.

Parity rule (as everywhere in the benchmarks): an arm whose range of repetitions overlaps
the best arm's range is reported as at parity with it, not behind.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

METRICS = ("ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_mean_ms",
           "goodput", "slo_attainment", "request_throughput", "hit_rate", "hit_tokens",
           "hit_tokens_local", "hit_tokens_external", "completed", "failed", "rejected",
           "prediction_error_median", "engine_busy_s", "emulator_lag_p99_max_s",
           "emulator_loop_lag_max_s", "router_added_p50_ms", "router_added_p99_ms",
           "router_cpu_ms_per_request", "load_average")


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return float(statistics.median(vals)) if vals else None


def aggregate(runs: Mapping[str, Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per arm: ``label``, ``summary`` (medians), ``range`` ([min, max] per metric) and
    ``reps`` (every repetition's row)."""
    out = []
    for label, rows in runs.items():
        summ: dict[str, Any] = {m: _median([r.get(m) for r in rows]) for m in METRICS}
        rng = {m: [min(v), max(v)] for m in METRICS
               if (v := [r[m] for r in rows if r.get(m) is not None])}
        out.append({"label": label, "summary": summ, "range": rng, "reps": list(rows)})
    return out


def verdicts(arms: Sequence[dict[str, Any]], metric: str, lower: bool) -> dict[str, str]:
    """Per arm: ``best``, ``parity`` (its range overlaps the best's) or ``behind``."""
    have = [a for a in arms if a["summary"].get(metric) is not None]
    if not have:
        return {}
    best = (min if lower else max)(have, key=lambda a: a["summary"][metric])
    lo, hi = best["range"][metric]
    out = {}
    for a in have:
        a_lo, a_hi = a["range"][metric]
        out[a["label"]] = ("best" if a is best else
                           "parity" if a_lo <= hi and a_hi >= lo else "behind")
    return out


def table(doc: dict[str, Any]) -> str:
    arms = doc["arms"]
    head = (f"{'arm':<28} {'TTFT mean':>10} {'p90':>8} {'p99':>8} {'goodput':>8} "
            f"{'SLO met':>7} {'hit rate':>8} {'fail':>5} {'rej':>5}  mean-range (ms)")
    lines = [doc["title"], head, "-" * len(head)]
    v = verdicts(arms, "ttft_mean_ms", True)

    def f(x: Any, spec: str) -> str:
        return "n/a" if x is None else format(x, spec)

    for a in arms:
        s = a["summary"]
        rng = a["range"].get("ttft_mean_ms", [None, None])
        lines.append(
            f"{a['label']:<28} {f(s['ttft_mean_ms'], '.0f'):>10} {f(s['ttft_p90_ms'], '.0f'):>8} "
            f"{f(s['ttft_p99_ms'], '.0f'):>8} {f(s['goodput'], '.2f'):>8} "
            f"{f(s['slo_attainment'], '.0%'):>7} {f(s['hit_rate'], '.3f'):>8} "
            f"{f(s['failed'], '.0f'):>5} {f(s['rejected'], '.0f'):>5}  "
            f"{f(rng[0], '.0f')}-{f(rng[1], '.0f')} {v.get(a['label'], '')}")
    lines.append(", ".join(f"{k}: {v}" for k, v in doc["summary"].items()))
    return "\n".join(lines)


def figure(doc: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = doc["arms"]
    labels = [a["label"] for a in arms]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    for ax, metrics, ylabel in ((axes[0], ("ttft_mean_ms", "ttft_p90_ms"), "TTFT (ms)"),
                                (axes[1], ("ttft_p99_ms",), "TTFT p99 (ms)"),
                                (axes[2], ("goodput",), "goodput (req/s within SLO)")):
        width = 0.8 / len(metrics)
        for j, m in enumerate(metrics):
            xs = [i + j * width for i in range(len(arms))]
            med = [a["summary"][m] or 0 for a in arms]
            lo = [max(0.0, med[i] - a["range"].get(m, [med[i]] * 2)[0]) for i, a in enumerate(arms)]
            hi = [max(0.0, a["range"].get(m, [med[i]] * 2)[1] - med[i]) for i, a in enumerate(arms)]
            ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=m.replace("_ms", ""))
        ax.set_xticks([i + width * (len(metrics) - 1) / 2 for i in range(len(arms))])
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        if len(metrics) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(f"{doc['title']} (median of {doc['summary'].get('reps')} runs, bars: range)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def per_request(res: dict[str, Any], urls: Sequence[str]) -> dict[str, Any]:
    """Where each request went and what the engine found, joined on ``x-request-id``:
    columns ``ttft_ms`` (client), ``engine_ttft_ms`` (arrival at the engine to its first
    token: the difference is the router's and the network's), ``instance``,
    ``local_hit``, ``external_hit`` (tokens), ``queue_ms`` (engine: arrival to
    admission), ``prompt_tokens``; plus how many requests each instance served."""
    by_id = {r["request_id"]: r for r in res.get("engine_requests", [])}
    index = {f"emu{i}": i for i in range(len(urls))}
    cols: dict[str, list[Any]] = {k: [] for k in ("ttft_ms", "engine_ttft_ms", "router_ms",
                                                   "instance",
                                                   "local_hit", "external_hit", "queue_ms",
                                                   "prompt_tokens", "start_s")}
    tag = f"{res['label']}.{res['rep']}"
    d = float(res.get("dilation", 1.0))  # columns in emulated time
    for r in res["requests"]:
        e = by_id.get(f"{tag}/{r['sid']}/{r['turn']}")
        if not r["success"] or e is None:
            continue
        cols["ttft_ms"].append(round(r["ttft_s"] * 1e3 / d, 1))
        cols["engine_ttft_ms"].append(round(((e["first_token"] or e["arrival"])
                                             - e["arrival"]) * 1e3 / d, 1))
        cols["router_ms"].append(None if r.get("router_s") is None
                                 else round(r["router_s"] * 1e3 / d, 1))
        cols["instance"].append(index.get(e["engine"], -1))
        cols["local_hit"].append(e["local_hit"])
        cols["external_hit"].append(e["external_hit"])
        cols["queue_ms"].append(round(((e["admitted"] or e["arrival"]) - e["arrival"])
                                      * 1e3 / d, 1))
        cols["prompt_tokens"].append(e["prompt_tokens"])
        cols["start_s"].append(round(r["start_s"] / d, 3))
    served = [0] * len(urls)
    for i in cols["instance"]:
        if i >= 0:
            served[i] += 1
    return {"columns": cols, "served_per_instance": served}
