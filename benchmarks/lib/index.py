"""Generate benchmarks/README.md, the index of every benchmark, from docstrings and results.

    python -m benchmarks.lib.index [--check]

Every module under ``benchmarks/<group>/`` (a package; its docstring's first line titles
its table) that runs as ``python -m`` (it has an ``if __name__ == "__main__":`` block) is
listed in its group's table. A benchmark's
docstring opens with one line, the question it answers (ending in ``?``), and its usage
block names its command (indented lines starting ``python -m <the module>``); a tool's
first line says what it does. A benchmark's result files are the committed JSONs under
``benchmarks/results/`` whose recorded command (``meta.command``) runs it, under its
module name or under the script path it had before the benchmarks became a package
(:data:`MOVED`). Results made by anything else (tests, examples) are listed with their
commands at the end. The output is a function of the files; ``--check`` writes nothing
and exits 1 when the README is out of date.
"""

from __future__ import annotations

import argparse
import ast
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.lib.paths import RESULTS, ROOT

README = ROOT / "benchmarks" / "README.md"
ORDER = ("micro", "serving", "sim", "reliability")  # then any other group, lib/ last
# Runnable modules outside lib/ that answer no question of their own.
TOOLS = frozenset({"benchmarks.serving.lmcache_peer", "benchmarks.reliability.router_probe",
                   "benchmarks.emulator.server"})
# Script paths before the benchmarks became a package -> their module (results recorded
# then name the script).
MOVED = {
    "benchmarks/bench_capacity.py": "benchmarks.sim.capacity",
    "benchmarks/bench_connectors.py": "benchmarks.serving.connectors",
    "benchmarks/bench_cudagraph_modes.py": "benchmarks.micro.cudagraph_modes",
    "benchmarks/bench_gpu_path.py": "benchmarks.micro.gpu_path",
    "benchmarks/bench_integrity.py": "benchmarks.micro.integrity",
    "benchmarks/bench_kernels.py": "benchmarks.micro.kernels",
    "benchmarks/bench_knee.py": "benchmarks.serving.knee",
    "benchmarks/bench_lookups.py": "benchmarks.micro.lookups",
    "benchmarks/bench_router.py": "benchmarks.micro.router_decision",
    "benchmarks/bench_router_overhead.py": "benchmarks.serving.router_overhead",
    "benchmarks/bench_serving.py": "benchmarks.serving.loadgen",
    "benchmarks/bench_store.py": "benchmarks.micro.store",
    "benchmarks/bench_store_mooncake.py": "benchmarks.micro.store_mooncake",
    "benchmarks/bench_tiers.py": "benchmarks.serving.tiers",
    "benchmarks/bench_ttft.py": "benchmarks.serving.ttft",
    "benchmarks/compare.py": "benchmarks.serving.compare",
    "benchmarks/dashboard_screenshot.py": "benchmarks.serving.dashboard_screenshot",
    "benchmarks/faults.py": "benchmarks.reliability.faults",
    "benchmarks/report.py": "benchmarks.lib.report",
    "benchmarks/simulate_cluster.py": "benchmarks.sim.routing",
    "benchmarks/soak.py": "benchmarks.reliability.soak",
    "benchmarks/soak_router.py": "benchmarks.reliability.soak_router",
}


@dataclass(frozen=True)
class Entry:
    """One runnable module: its name, first docstring line, usage lines, and whether it
    is a benchmark (a question) or a tool."""

    module: str
    summary: str
    usage: tuple[str, ...]
    benchmark: bool


def runnable(path: Path) -> bool:
    """Whether the module at ``path`` runs as ``python -m`` (has a ``__main__`` block)."""
    return 'if __name__ == "__main__":' in path.read_text()


def entry(path: Path, root: Path = ROOT) -> Entry:
    """The :class:`Entry` of the module at ``path`` (a file under ``root``)."""
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    lines = doc.splitlines()
    group = module.split(".")[1]
    return Entry(module, lines[0].strip() if lines else "", usage_lines(lines, module),
                 group != "lib" and module not in TOOLS)


def usage_lines(lines: Sequence[str], module: str) -> tuple[str, ...]:
    """The docstring's commands: each indented line that starts ``python -m <module>``,
    with the more-indented lines that continue it, on one line (``\\`` dropped)."""
    out: list[str] = []
    for i, line in enumerate(lines):
        if not (line.startswith("    ") and line.strip().startswith(f"python -m {module}")):
            continue
        indent = len(line) - len(line.lstrip())
        parts = [line.strip()]
        for nxt in lines[i + 1:]:
            if not nxt.strip() or len(nxt) - len(nxt.lstrip()) <= indent:
                break
            parts.append(nxt.strip())
        out.append(" ".join(p.rstrip("\\").strip() for p in parts))
    return tuple(out)


def groups(root: Path = ROOT) -> list[tuple[str, str]]:
    """(name, title) of every package under ``root/benchmarks/`` in index order; the title
    is the first line of its ``__init__.py`` docstring."""
    found = sorted(p.parent.name for p in (root / "benchmarks").glob("*/__init__.py"))
    rank = {g: i for i, g in enumerate(ORDER)}
    found.sort(key=lambda g: (g == "lib", rank.get(g, len(ORDER)), g))
    out = []
    for g in found:
        doc = ast.get_docstring(ast.parse((root / "benchmarks" / g / "__init__.py").read_text()))
        out.append((g, (doc or "").split("\n")[0].strip()))
    return out


def entries(root: Path = ROOT) -> list[Entry]:
    """Every runnable module under ``root/benchmarks/<group>/``, by group then name."""
    out = []
    for group, _ in groups(root):
        for path in sorted((root / "benchmarks" / group).rglob("*.py")):
            if path.name != "__init__.py" and runnable(path):
                out.append(entry(path, root))
    return out


def producer(command: str | None) -> str | None:
    """The benchmark module a recorded command runs (``python -m M`` or a script path,
    after any ``VAR=value`` prefix), or None (pytest, an example, nothing recorded)."""
    if not command:
        return None
    words = [w for w in shlex.split(command) if "=" not in w.split("/")[0]]
    if len(words) < 2 or not Path(words[0]).name.startswith("python"):
        return None
    if words[1] == "-m":
        return words[2] if len(words) > 2 and words[2].startswith("benchmarks.") else None
    return MOVED.get(words[1])


def result_docs(results: Path = RESULTS) -> list[tuple[str, dict[str, object]]]:
    """(file name, document) of every committed result JSON (not the ``logs/`` scratch)."""
    return [(p.relative_to(results).as_posix(), json.loads(p.read_text()))
            for p in sorted(results.rglob("*.json")) if "logs" not in p.relative_to(results).parts]


def _command(doc: dict[str, object]) -> str | None:
    m = doc.get("meta")
    return str(m.get("command")) if isinstance(m, dict) and m.get("command") else None


def render(root: Path = ROOT, results: Path = RESULTS) -> str:
    """The whole ``benchmarks/README.md``."""
    docs = result_docs(results)
    owned: dict[str, list[str]] = {}
    others = []
    for rel, doc in docs:
        mod = producer(_command(doc))
        if mod is None:
            others.append((rel, _command(doc)))
        else:
            owned.setdefault(mod, []).append(rel)
    es = entries(root)
    lines = ["# Benchmarks", "",
             "<!-- generated by `python -m benchmarks.lib.index` from the modules' docstrings "
             "and benchmarks/results/*.json; edit those, not this file -->", "",
             "Each benchmark answers one question, runs from the repository root as "
             "`python -m benchmarks.<group>.<name>` (`--help` lists its options), writes its "
             "result under `benchmarks/results/` (the command, machine and git commit in "
             "`meta`) and compares against a baseline measured in the same run. "
             "`make report` renders every result into "
             "[results/REPORT.md](results/REPORT.md).", ""]
    for group, title in groups(root):
        group_entries = [e for e in es if e.module.split(".")[1] == group]
        if not group_entries:
            continue
        lines += [f"## `{group}/`", "", *([title, ""] if title else []),
                  "| module | question | command | results |", "|---|---|---|---|"]
        for e in group_entries:
            cmds = "<br>".join(f"`{_cell(u)}`" for u in e.usage) or f"`python -m {e.module}`"
            res = ", ".join(f"[`{r}`](results/{r})" for r in owned.get(e.module, []))
            what = _cell(e.summary) if e.benchmark else f"(tool) {_cell(e.summary)}"
            lines.append(f"| `{e.module}` | {what} | {cmds} | {res or '-'} |")
        lines.append("")
    if others:
        lines += ["## Results made by tests and examples", "",
                  "Made by no benchmark module; each records the test or example that wrote it.",
                  "", "| result | command |",
                  "|---|---|"]
        lines += [f"| [`{r}`](results/{r}) | `{_cell(c or 'not recorded')}` |"
                  for r, c in others]
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only say whether it is current")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = README.is_file() and README.read_text() == text
        print("up to date" if current else f"out of date: {README}")
        return 0 if current else 1
    README.write_text(text)
    print(f"wrote {README}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
