"""Render every result JSON into REPORT.md and README's results table (make report).

Render every result JSON under ``benchmarks/results/`` into one ``REPORT.md``, and
README's results table from the same data (``make report``).

    python -m benchmarks.lib.report [--results DIR] [--out FILE] [--readme FILE] [--check]

One section per JSON (sorted by path; ``logs/``, the benchmarks' gitignored scratch, is
left out): what made it (``meta.command``), where (``meta.machine``) and from which code
(``meta.git``: commit, and whether the tree differed), all written by
:mod:`benchmarks.lib.results_writer`, else "not recorded" (no committed result may show
that: tests/bench/test_report.py); its tables (load generator results and comparisons as arm
tables, anything else from its ``summary``, its lists of rows and its per-arm/per-policy
mappings); and its PNGs
(listed in ``figures``, else the PNGs named after it). README's block between
:data:`BEGIN` and :data:`END` is rewritten with one row per arm of every full (not
``_quick``) comparison and connector benchmark. The output is a function of the files:
running it twice gives the same bytes. ``--check`` writes nothing and exits 1 when
``REPORT.md`` or README's block is out of date.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.lib.paths import RESULTS, ROOT
from benchmarks.lib.report_tables import (
    cell,
    doc_tables,
    readme_rows,
)
from benchmarks.lib.results_writer import describe_git, describe_machine

README = ROOT / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
NOT_RECORDED = "not recorded"  # tests/bench/test_report.py: no committed result may show it
SCRATCH = "logs"  # benchmarks/results/logs/: servers' logs and configs, gitignored

Docs = list[tuple[str, dict[str, Any]]]


def result_files(results: Path, suffix: str) -> list[str]:
    """Paths (relative, sorted) of the ``*<suffix>`` files below ``results``, not scratch."""
    rels = (p.relative_to(results).as_posix() for p in results.rglob(f"*{suffix}"))
    return sorted(r for r in rels if r.split("/")[0] != SCRATCH)


def load(results: Path) -> Docs:
    """(path relative to ``results``, document) of every result JSON below it, sorted."""
    return [(rel, json.loads((results / rel).read_text()))
            for rel in result_files(results, ".json")]


def figures(results: Path, docs: Docs) -> tuple[dict[str, list[tuple[str, str]]], list[str]]:
    """Each JSON's figures as (PNG path relative to ``results``, title), and the PNGs no
    JSON claims. A JSON's ``figures`` list wins; otherwise a PNG belongs to the JSON whose
    stem is the longest one its name equals or starts with followed by ``_``."""
    pngs = result_files(results, ".png")
    claimed: dict[str, list[tuple[str, str]]] = {rel: [] for rel, _ in docs}
    taken = set()
    for rel, doc in docs:
        folder = Path(rel).parent
        for f in doc.get("figures") or []:
            png = (folder / f["file"]).as_posix()
            claimed[rel].append((png, str(f.get("title") or "")))
            taken.add(png)
    stems = {rel[:-len(".json")]: rel for rel, doc in docs if not doc.get("figures")}
    for png in pngs:
        if png in taken:
            continue
        stem = png[:-len(".png")]
        owners = [s for s in stems if stem == s or stem.startswith(s + "_")]
        if owners:
            owner = stems[max(owners, key=len)]
            claimed[owner].append((png, stem[len(owner) - len(".json"):].strip("_")))
            taken.add(png)
    return claimed, [p for p in pngs if p not in taken]


def command_of(doc: dict[str, Any]) -> str:
    meta = doc.get("meta") or {}
    cmd = meta.get("command")
    if not cmd:
        return NOT_RECORDED
    note = f" ({meta['command_recorded']})" if meta.get("command_recorded") else ""
    return f"`{cmd}`{note}"


def commit_of(doc: dict[str, Any]) -> str:
    return describe_git((doc.get("meta") or {}).get("git") or {}) or NOT_RECORDED


def machine_of(doc: dict[str, Any]) -> str:
    m = (doc.get("meta") or {}).get("machine") or doc.get("machine")
    if isinstance(m, dict) and describe_machine(m):
        return describe_machine(m)
    return NOT_RECORDED + (f" (the JSON says cpus: {doc['cpus']})" if "cpus" in doc else "")


def section(rel: str, doc: dict[str, Any], figs: Sequence[tuple[str, str]]) -> list[str]:
    """The markdown of one result file."""
    title = doc.get("title") or doc.get("label") or ""
    cmd, where = command_of(doc), machine_of(doc)
    lines = [f"## `{rel}`", ""] + ([f"**{cell(title)}**", ""] if title else [])
    lines += [f"- Command: {cmd}", f"- Machine: {where}", f"- Commit: {commit_of(doc)}", ""]
    lines += doc_tables(doc)
    for png, caption in figs:
        lines += [f"![{cell(caption or png)}]({png})", "",
                  f"*`{png}`{': ' + cell(caption) if caption else ''}. Command: {cmd}. "
                  f"Machine: {where}.*", ""]
    return lines


def render(results: Path) -> str:
    """The whole ``REPORT.md`` for the files under ``results``."""
    docs = load(results)
    claimed, orphans = figures(results, docs)
    lines = ["# Benchmark results", "",
             f"Generated by `make report` (`python -m benchmarks.lib.report`) from the "
             f"{len(docs)} JSON files under `benchmarks/results/`; do not edit by hand. "
             "Numbers are as each run recorded them; \"n/a\": not measured.", "",
             "Contents:", ""]
    lines += [f"- [`{rel}`](#{_anchor(rel)})" for rel, _ in docs]
    lines.append("")
    for rel, doc in docs:
        lines += section(rel, doc, claimed[rel])
    if orphans:
        lines += ["## Figures without a result file", ""]
        lines += [f"![{p}]({p})" + "\n" for p in orphans]
    return "\n".join(lines).rstrip("\n") + "\n"


def _anchor(rel: str) -> str:
    """GitHub's anchor of a ``## `rel`...`` heading (lower case, punctuation dropped)."""
    keep = "".join(c for c in rel.lower() if c.isalnum() or c in "-_ ")
    return keep.replace(" ", "-")


def readme_block(results: Path) -> str:
    """README's results block, markers included."""
    rows = readme_rows(load(results))
    lines = [BEGIN,
             "<!-- generated by `make report` from benchmarks/results/*.json; "
             "edit the JSONs' producers, not this table -->",
             "| result | baseline | ours | TTFT mean, baseline -> ours (speedup) | "
             "throughput, baseline -> ours (ratio) |",
             "|---|---|---|---|---|", *rows, "",
             "Every result, its command, machine and figures: "
             "[benchmarks/results/REPORT.md](benchmarks/results/REPORT.md).", END]
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """``text`` with its BEGIN..END block replaced by ``block``; ``ValueError`` without one."""
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"README has no {BEGIN} ... {END} block")
    return text[:i] + block + text[j + len(END):]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=None, help="default: RESULTS/REPORT.md")
    ap.add_argument("--readme", default=str(README), help="README to update ('': none)")
    ap.add_argument("--check", action="store_true", help="only say whether they are current")
    args = ap.parse_args(argv)
    out = args.out or args.results / "REPORT.md"
    report = render(args.results)
    readme_path = Path(args.readme) if args.readme else None
    readme = readme_path.read_text() if readme_path else None
    new_readme = replace_block(readme, readme_block(args.results)) if readme else None
    if args.check:
        stale = [str(p) for p, old, new in ((out, _read(out), report),
                                            (readme_path, readme, new_readme)) if old != new]
        print("out of date: " + ", ".join(stale) if stale else "up to date")
        return 1 if stale else 0
    out.write_text(report)
    print(f"wrote {out}")
    if readme_path and new_readme and new_readme != readme:
        readme_path.write_text(new_readme)
        print(f"updated the results block of {readme_path}")
    return 0


def _read(p: Path) -> str | None:
    return p.read_text() if p.is_file() else None


if __name__ == "__main__":
    raise SystemExit(main())
