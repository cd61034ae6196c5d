"""Markdown tables of result documents, for ``benchmarks.lib.report``.

- bench_serving results (``"benchmark": "serving"``) and comparisons (``"comparison"`` with
  ``"arms"``): the arm table, ratios and utilisation of :mod:`benchmarks.serving.report`.
- Anything else: its scalar parameters in one line, its ``summary`` (scalars as metric |
  value, mappings as a metric x key matrix), every list of row mappings as a table and
  every mapping of mappings (arms, policies) as a matrix. Lists of numbers (per-request
  samples) are left out: they are data, not results.

Numbers print with 4 significant digits; the output depends on the documents only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from benchmarks.serving import report as serving_report

MAX_ROWS = 60  # longer tables are cut, saying so
SKIP = {"meta", "figures", "summary", "requests", "utilisation_samples"}


def cell(v: Any) -> str:
    """One table cell: floats to 4 significant digits (whole numbers from 1000 up), None
    as n/a, pipes escaped."""
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 or v.is_integer() else f"{v:.4g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    rows = list(rows)
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows[:MAX_ROWS]]
    if len(rows) > MAX_ROWS:
        lines.append(f"\n({len(rows) - MAX_ROWS} more rows in the JSON)")
    return [*lines, ""]


def _columns(maps: Iterable[Mapping[str, Any]]) -> list[str]:
    cols: list[str] = []
    for m in maps:
        cols += [k for k, v in m.items() if _scalar(v) and k not in cols]
    return cols


def matrix(mapping: Mapping[str, Mapping[str, Any]], corner: str) -> list[str]:
    """Rows: the keys of ``mapping``; columns: the scalar fields of their values."""
    cols = _columns(mapping.values())
    if not cols:
        return []
    return table([corner, *cols], ([k, *(v.get(c) for c in cols)] for k, v in mapping.items()))


def summary_tables(summary: Mapping[str, Any]) -> list[str]:
    scalars = [(k, v) for k, v in summary.items() if _scalar(v)]
    lines = table(["metric", "value"], scalars) if scalars else []
    groups: dict[tuple[str, ...], dict[str, Mapping[str, Any]]] = {}
    for k, v in summary.items():  # mappings of scalars with the same keys: one matrix
        if isinstance(v, Mapping) and any(_scalar(x) for x in v.values()):
            groups.setdefault(tuple(v), {})[k] = v
    for group in groups.values():
        lines += matrix(group, "metric")
    for k, v in summary.items():  # mappings of mappings, e.g. {ratio: {placement: value}}
        if isinstance(v, Mapping) and v and all(isinstance(x, Mapping) for x in v.values()):
            lines += [f"`{k}`:", "", *matrix(v, k)]
    return lines


def params(doc: Mapping[str, Any]) -> list[str]:
    items = [f"{k}={cell(v)}" for k, v in doc.items() if _scalar(v) and k not in SKIP]
    for name in ("workload", "config", "fleet"):
        sub = doc.get(name)
        if isinstance(sub, Mapping):
            items += [f"{name}.{k}={cell(v)}" for k, v in sub.items()
                      if _scalar(v) and v is not None]
    return ["Parameters: " + ", ".join(items), ""] if items else []


def generic(doc: Mapping[str, Any]) -> list[str]:
    lines = params(doc)
    if isinstance(doc.get("summary"), Mapping):
        lines += ["Summary:", "", *summary_tables(doc["summary"])]
    for k, v in doc.items():
        if k in SKIP:
            continue
        if isinstance(v, list) and v and all(isinstance(x, Mapping) for x in v):
            lines += [f"`{k}`:", "", *table(_columns(v), ([x.get(c) for c in _columns(v)]
                                                        for x in v))]
        elif isinstance(v, Mapping) and v and all(isinstance(x, Mapping) for x in v.values()):
            lines += [f"`{k}`:", "", *matrix(v, k)]
    return lines


def doc_tables(doc: Mapping[str, Any]) -> list[str]:
    """The markdown tables of one result document."""
    if doc.get("benchmark") == "serving":
        return [*params(doc), *serving_report.arm_table([doc]),
                *serving_report.utilisation_table([doc]), ""]
    if doc.get("comparison") and isinstance(doc.get("arms"), list):
        arms = doc["arms"]
        return [*params({"workload": doc.get("workload"), "fleet": doc.get("fleet")}),
                *serving_report.arm_table(arms), "",
                *serving_report.ratio_lines(doc), *serving_report.utilisation_table(arms), ""]
    return generic(doc)


# ------------------------------------------------------------------------------ README

def _speed(base: float | None, ours: float | None, unit: str, inverse: bool) -> str:
    if base is None or ours is None:
        return "n/a"
    r = (base / ours if inverse else ours / base) if (ours if inverse else base) else None
    digits = ".3f" if max(base, ours) < 10 else ".0f"
    return (f"{base:{digits}} -> {ours:{digits}} {unit}"
            + (f" ({r:.2f}x)" if r is not None else ""))


def comparison_rows(rel: str, doc: Mapping[str, Any]) -> list[str]:
    arms = {a["label"]: a["summary"] for a in doc["arms"]}
    base = arms[doc["baseline"]]
    rows = []
    for label, s in arms.items():
        if label == doc["baseline"]:
            continue
        good = base.get("goodput") is not None and s.get("goodput") is not None
        key, unit = ("goodput", "req/s goodput") if good else ("request_throughput", "req/s")
        rows.append(f"| `{rel}`: {cell(doc.get('title', ''))} | {doc['baseline']} | {label} "
                    f"| {_speed(base['ttft_mean_ms'], s['ttft_mean_ms'], 'ms', True)} "
                    f"| {_speed(base.get(key), s.get(key), unit, False)} |")
    return rows


CONNECTOR_ARMS = ("mooncake_store_connector", "kvcentric")  # (peer, ours) in bench_connectors


def connector_rows(rel: str, doc: Mapping[str, Any]) -> list[str]:
    """The connectors row; when the arms' per-repetition mean TTFTs overlap the TTFT cell
    says parity and gives both ranges instead of a speedup."""
    s = doc.get("summary") or {}
    peer, ours = CONNECTOR_ARMS
    ttft, rps = s.get("ttft_mean_ms") or {}, s.get("requests_per_s") or {}
    if peer not in ttft or ours not in ttft:
        return []
    speed = _speed(ttft[peer], ttft[ours], "ms", True)
    runs = s.get("ttft_mean_ms_by_repeat") or {}
    if s.get(f"verdict_{ours}_vs_{peer}") == "parity" and peer in runs and ours in runs:
        speed = (f"{ttft[peer]:.0f} -> {ttft[ours]:.0f} ms: parity (per repetition "
                 f"{min(runs[peer]):.0f}-{max(runs[peer]):.0f} vs "
                 f"{min(runs[ours]):.0f}-{max(runs[ours]):.0f} ms)")
    return [f"| `{rel}`: connectors through vLLM on a Mooncake Store | {peer} | {ours} "
            f"| {speed} | {_speed(rps.get(peer), rps.get(ours), 'req/s', False)} |"]


def readme_rows(docs: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """One README row per arm of each full (not ``_quick``) comparison and connector run."""
    rows = []
    for rel, doc in docs:
        if rel.endswith("_quick.json") or doc.get("quick"):
            continue
        if doc.get("comparison") and isinstance(doc.get("arms"), list):
            rows += comparison_rows(rel, doc)
        elif doc.get("benchmark") == "connectors":
            rows += connector_rows(rel, doc)
    return rows
