"""A comparison's outputs: ratios over the baseline arm, a markdown table, JSON and PNGs
(TTFT CDF, throughput bars, each instance's load per arm), through :mod:`results_writer`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.lib import plot, results_writer
from benchmarks.serving import utilisation


def same_instance_rate(requests: Sequence[dict[str, Any]]) -> float | None:
    """Share of follow-up turns sent to the URL that served the user's previous turn."""
    by_user: dict[str, list[dict[str, Any]]] = {}
    for r in requests:
        by_user.setdefault(r["sid"], []).append(r)
    pairs = same = 0
    for turns in by_user.values():
        turns.sort(key=lambda r: r["turn"])
        for a, b in zip(turns, turns[1:]):
            pairs += 1
            same += a["url"] == b["url"]
    return same / pairs if pairs else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def ratios(base: dict[str, Any], arm: dict[str, Any]) -> dict[str, float | None]:
    """``arm`` over ``base``: speedups for latencies (base/arm), ratios for rates.

    A ratio over a zero or missing baseline value is None.
    """
    b, a = base["summary"], arm["summary"]
    return {"ttft_mean_speedup": _ratio(b["ttft_mean_ms"], a["ttft_mean_ms"]),
            "ttft_p90_speedup": _ratio(b["ttft_p90_ms"], a["ttft_p90_ms"]),
            "goodput_ratio": _ratio(a["goodput"], b["goodput"]),
            "request_throughput_ratio": _ratio(a["request_throughput"], b["request_throughput"]),
            "output_throughput_ratio": _ratio(a["output_throughput"], b["output_throughput"])}


def fmt(v: Any, spec: str = ".0f") -> str:
    return "n/a" if v is None else format(v, spec)


def arm_table(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown lines: one row of headline metrics per bench_serving result."""
    head = ("| arm | TTFT mean (ms) | TTFT p50 | TTFT p90 | TTFT p99 | TPOT mean (ms) | "
            "engine ITL (ms) | goodput (req/s) | SLO met | req/s | output tok/s | "
            "hit tokens (engine / external) | completed / failed / rejected | "
            "TTFT prediction error (median) |")
    lines = [head, "|" + "---|" * 14]
    for r in results:
        s, m = r["summary"], r["server_metrics"]
        lines.append(
            f"| {r['label']} | {fmt(s['ttft_mean_ms'])} | {fmt(s['ttft_p50_ms'])} | "
            f"{fmt(s['ttft_p90_ms'])} | {fmt(s['ttft_p99_ms'])} | {fmt(s['tpot_mean_ms'])} | "
            f"{fmt(m.get('engine_itl_ms'), '.1f')} | {fmt(s['goodput'], '.3f')} | "
            f"{fmt(s['slo_attainment'], '.0%')} | "
            f"{fmt(s['request_throughput'], '.3f')} | {fmt(s['output_throughput'], '.1f')} | "
            f"{fmt(m['hit_tokens_local'])} / {fmt(m['hit_tokens_external'])} | "
            f"{s['completed']} / {s['failed']} / {s['rejected']} | "
            f"{fmt(s.get('prediction_error_median'), '.0%')} |")
    return lines


def ratio_lines(cmp: Mapping[str, Any]) -> list[str]:
    """Markdown lines: each arm's ratios over the baseline."""
    lines = [f"Ratios over `{cmp['baseline']}`:", ""]
    for name, rs in cmp["ratios"].items():
        lines.append(f"- **{name}**: " + ", ".join(f"{k} {fmt(v, '.2f')}"
                                                   for k, v in rs.items()))
    return lines


def markdown(title: str, results: Sequence[dict[str, Any]], cmp: dict[str, Any],
             notes: Sequence[str]) -> str:
    return "\n".join([f"# {title}", "", *arm_table(results), "", *ratio_lines(cmp),
                      *utilisation_table(results), "", *notes, ""])


def utilisation_table(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown lines: each arm's instances' busy fraction, load and KV usage (none when
    no result carries utilisation)."""
    if not any(r.get("utilisation") for r in results):
        return []
    lines = ["", "Instance utilisation over the run (sampled from `/metrics`):", "",
             "| arm | instance | busy | running mean | waiting mean (max) | KV usage mean "
             "(max) | load imbalance |", "|" + "---|" * 7]
    for r in results:
        u = r.get("utilisation") or {"per_instance": {}, "load_imbalance": None}
        for i, s in enumerate(u["per_instance"].values()):
            lines.append(
                f"| {r['label']} | {i} | {fmt(s['busy_fraction'], '.0%')} | "
                f"{fmt(s['running_mean'], '.2f')} | {fmt(s['waiting_mean'], '.2f')} "
                f"({fmt(s['waiting_max'])}) | {fmt(s['kv_usage_mean'], '.0%')} "
                f"({fmt(s['kv_usage_max'], '.0%')}) | {fmt(u['load_imbalance'], '.2f')} |")
    return lines


def write(out_dir: Path, name: str, title: str, results: list[dict[str, Any]], baseline: str,
          extra: dict[str, Any], notes: list[str], command: str | None = None) -> dict[str, Any]:
    """Write ``<name>.json``, ``<name>.md`` and the PNGs under ``out_dir``; print the table.

    ``command``: the command line that ran the comparison (recorded in the JSON).
    """
    base = next(r for r in results if r["label"] == baseline)
    cmp = {"baseline": baseline, "ratios": {r["label"]: ratios(base, r) for r in results
                                            if r is not base}}
    predicted = {r["label"]: r["summary"].get("prediction_error_median") for r in results
                 if r["summary"].get("predicted_requests")}
    doc = {"comparison": name, "title": title, **extra, **cmp, "arms": results}
    if predicted:  # the arms behind the kvcentric router: how good its TTFT predictions were
        doc["summary"] = {"prediction_error_median": predicted}
    text = markdown(title, results, cmp, notes)
    figs = [results_writer.Figure("ttft_cdf", "TTFT CDF per arm",
                                  lambda p: plot.ttft_cdf(results, p, title)),
            results_writer.Figure("throughput", "Throughput and goodput per arm",
                                  lambda p: plot.throughput_bars(results, p, title))]
    if any(r.get("utilisation") for r in results):
        figs.append(results_writer.Figure(
            "utilisation", "Per-instance load (running + waiting) and KV usage per arm",
            lambda p: utilisation.boxes(results, p, title)))
    results_writer.write(out_dir / f"{name}.json", doc, text, figs, command)
    (out_dir / f"{name}.md").write_text(text)
    print("wrote", out_dir / f"{name}.md")
    return doc
