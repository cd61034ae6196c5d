"""Summary, table and figure of a :mod:`benchmarks.serving.connectors` result.

:func:`summarise` turns the arms' results into the ratios between arms (mean, median,
later turns, the paired per-request median), each with a verdict that reads the
repetitions (:func:`verdict`: ``parity`` when the arms' per-repetition means overlap) and,
from vLLM's per-request phase
histograms, where the later turns' time goes and the bound on any connector against
vLLM's MooncakeStoreConnector (:func:`split_summary`). :func:`print_table` and
:func:`plot` show them; ``python -m benchmarks.serving.connectors --summarise FILE``
recomputes all three from a stored result. An arm that did not do the work it is timed
for (``valid`` false, :mod:`benchmarks.serving.work`) is left out of every ratio.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

ARMS = ("no_connector", "mooncake_store_connector", "kvcentric", "kvcentric_whole_get",
        "lmcache")


def summarise(arms: dict[str, dict[str, Any]], users: int) -> dict[str, Any]:
    """Per-arm figures and the ratios between arms (``users``: the first ``users``
    requests are first turns, prefilled cold in every arm; later turns can hit a store)."""
    ok = {a: r for a, r in arms.items() if r["status"] == "ok" and r.get("valid", True)}
    ref = ok.get("no_connector", {}).get("outputs")
    out: dict[str, Any] = {
        "status": {a: r["status"] for a, r in arms.items()},
        "invalid": {a: r.get("invalid_reason", "") for a, r in arms.items()
                    if r["status"] == "ok" and not r.get("valid", True)},
        "ttft_mean_ms_by_repeat": {a: [statistics.mean(run) for run in r["ttft_ms_runs"]]
                                   for a, r in ok.items() if r.get("ttft_ms_runs")},
        "ttft_mean_ms": {a: r["ttft_mean_ms"] for a, r in ok.items()},
        "ttft_p90_ms": {a: r["ttft_p90_ms"] for a, r in ok.items()},
        "ttft_median_ms": {a: r["ttft_median_ms"] for a, r in ok.items()},
        "ttft_first_turn_mean_ms": {a: statistics.mean(r["ttft_ms"][:users])
                                    for a, r in ok.items()},
        "ttft_later_turns_mean_ms": {a: statistics.mean(r["ttft_ms"][users:])
                                     for a, r in ok.items() if len(r["ttft_ms"]) > users},
        "hit_tokens": {a: r["hit_tokens"] for a, r in ok.items()},
        "external_hit_tokens": {a: r["external_hit_tokens"] for a, r in ok.items()},
        "engine_hit_tokens": {a: r["engine_hit_tokens"] for a, r in ok.items()},
        "requests_per_s": {a: r["requests_per_s"] for a, r in ok.items()},
        "outputs_match_no_connector": {
            a: r["outputs"] == ref and r.get("outputs_same_every_repeat", True)
            for a, r in ok.items() if ref is not None},
    }
    if "kvcentric" in ok and "mooncake_store_connector" in ok:
        out["outputs_match_between_connectors"] = \
            ok["kvcentric"]["outputs"] == ok["mooncake_store_connector"]["outputs"]
    out.update(split_summary(ok, users))
    for a, b in (("mooncake_store_connector", "no_connector"), ("kvcentric", "no_connector"),
                 ("kvcentric", "mooncake_store_connector"),
                 ("kvcentric_whole_get", "mooncake_store_connector"),
                 ("kvcentric", "kvcentric_whole_get"), ("lmcache", "no_connector"),
                 ("kvcentric", "lmcache")):
        if a in ok and b in ok:
            out.update(_ratios(out, ok, a, b, users))
    return out


def split_summary(ok: dict[str, dict[str, Any]], users: int) -> dict[str, Any]:
    """Where the later turns' time goes, per arm (mean ms of vLLM's queue and prefill
    phases and of our connector's counters), and the bound on any connector against
    vLLM's MooncakeStoreConnector: its TTFT with its load (its requests' queue time: the
    load runs before the request is scheduled) taken away, over its TTFT. No connector
    can beat that ratio on this machine, however fast its loads."""
    split = {a: r["engine_split_ms"][users:] for a, r in ok.items()
             if r.get("engine_split_ms") and len(r["engine_split_ms"]) > users}
    out: dict[str, Any] = {"later_turns_engine_split_ms": {
        a: {k: statistics.mean(x[k] for x in rows) for k in rows[0]}
        for a, rows in split.items()}}
    ref = ok.get("mooncake_store_connector")
    if ref is not None and ref.get("engine_split_ms"):
        free = [t - s["queue"] for t, s in zip(ref["ttft_ms"], ref["engine_split_ms"])]
        out["ttft_zero_cost_load_vs_mooncake_store_connector"] = \
            statistics.mean(free) / statistics.mean(ref["ttft_ms"])
    return out


def _ratios(out: dict[str, Any], ok: dict[str, dict[str, Any]], a: str, b: str,
            users: int) -> dict[str, float]:
    """``a`` over ``b``: mean, median, later-turn mean, and the median of per-request
    ratios (the same request in both arms: the comparison least moved by one slow
    request on a shared machine)."""
    later = out["ttft_later_turns_mean_ms"]
    r = {f"ttft_{a}_vs_{b}": out["ttft_mean_ms"][a] / out["ttft_mean_ms"][b],
         f"ttft_median_{a}_vs_{b}": out["ttft_median_ms"][a] / out["ttft_median_ms"][b],
         f"ttft_paired_median_{a}_vs_{b}": statistics.median(
             x / y for x, y in zip(ok[a]["ttft_ms"], ok[b]["ttft_ms"]))}
    if a in later and b in later:
        r[f"ttft_later_turns_{a}_vs_{b}"] = later[a] / later[b]
    runs = out["ttft_mean_ms_by_repeat"]
    if a in runs and b in runs:
        r[f"verdict_{a}_vs_{b}"] = verdict(runs[a], runs[b])  # type: ignore[assignment]
    return r


def verdict(a: list[float], b: list[float]) -> str:
    """``a`` against ``b`` from their per-repetition mean TTFTs: ``faster`` / ``slower``
    when every repetition of one is below every repetition of the other, ``parity`` when
    the ranges overlap, ``one repetition`` when either has a single one (no spread)."""
    if len(a) < 2 or len(b) < 2:
        return "one repetition"
    if max(a) < min(b):
        return "faster"
    if min(a) > max(b):
        return "slower"
    return "parity"


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [a for a in ARMS if a in res["summary"]["ttft_mean_ms"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(ok))
    a1.bar([x - 0.2 for x in xs], [res["summary"]["ttft_mean_ms"][a] for a in ok], 0.4,
           label="mean")
    a1.bar([x + 0.2 for x in xs], [res["summary"]["ttft_p90_ms"][a] for a in ok], 0.4,
           label="p90")
    a1.set_xticks(list(xs), [a.replace("_", "\n", 1) for a in ok], fontsize=8)
    a1.set(ylabel="TTFT (ms)", title="TTFT per arm")
    a1.legend()
    for a in ok:
        a2.plot(res["arms"][a]["ttft_ms"], marker="o", label=a)
    a2.set(xlabel="request (turn-major, round-robin over users)", ylabel="TTFT (ms)",
           title=f"TTFT per request (median of {res.get('repeats', 1)} runs)")
    a2.legend(fontsize=8)
    wl = res["workload"]
    fig.suptitle(f"vLLM CPU, bench model: {wl['users']} users x {wl['turns']} turns, "
                 f"engine cache {wl['engine_blocks']} blocks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(res: dict[str, Any]) -> None:
    s = res["summary"]
    later = s.get("ttft_later_turns_mean_ms", {})
    print(f"\n{'arm':>26} {'TTFT mean':>10} {'p90':>8} {'median':>8} {'turns 2+':>9} "
          f"{'req/s':>7} {'engine hit':>11} {'store hit':>10} {'same tokens':>12}")
    for a in ARMS:
        r = res["arms"].get(a, {"status": "not run"})
        if r["status"] != "ok":
            print(f"{a:>26} {r['status']}")
            continue
        if not r.get("valid", True):
            print(f"{a:>26} INVALID: {r.get('invalid_reason')}")
            continue
        print(f"{a:>26} {r['ttft_mean_ms']:10.0f} {r['ttft_p90_ms']:8.0f} "
              f"{r['ttft_median_ms']:8.0f} {later.get(a, float('nan')):9.0f} "
              f"{r['requests_per_s']:7.3f} "
              f"{r['engine_hit_tokens']:11.0f} "
              f"{r['external_hit_tokens']:10.0f} "
              f"{str(s['outputs_match_no_connector'].get(a, '-')):>12}")
    split = s.get("later_turns_engine_split_ms", {})
    if split:
        print("\nlater turns, mean ms per request: vLLM's queue and prefill phases; ours' "
              "connector counters (load_wait: the forward waiting for layers)")
        for a, d in split.items():
            print(f"{a:>26} " + " ".join(f"{k} {v:.1f}" for k, v in d.items()))
    for k, v in s.items():
        if k.startswith("ttft_") and "_vs_" in k and isinstance(v, float):
            print(f"{k}: {v:.3f}")
        elif k.startswith("verdict_"):
            print(f"{k}: {v}")
    for a, runs in s.get("ttft_mean_ms_by_repeat", {}).items():
        print(f"{a}: mean TTFT per repetition {min(runs):.0f}-{max(runs):.0f} ms")
    for a in ARMS:
        calls = res["arms"].get(a, {}).get("mooncake_calls_per_request")
        if calls:
            print(f"\nMooncake store calls per request, {a}:")
            for name, c in sorted(calls.items(), key=lambda kv: -kv[1]["ms"]):
                print(f"  {name:>36} {c['calls']:8.1f} calls {c['ms']:9.1f} ms")
