"""Render pytest junit XMLs as a markdown table of the slowest tests and the run's totals.

Render the junit XMLs of one run (``make test`` writes ``build/junit.xml`` for its
parallel pass and ``build/junit-serial.xml`` for its serial one) as a markdown table: the
slowest tests, the slowest files, and the run's totals (tests, outcomes, wall time and
where it ran), for the durations table committed with a full run. Several files are one
run whose passes ran one after another: their cases add up, and so do their wall times.

    python -m benchmarks.lib.durations build/junit.xml [build/junit-serial.xml ...]
        [--top 25] [--files 10]

A test's time is what pytest recorded for it (setup, call and teardown: ``make test``
keeps the junit default ``junit_duration_report=total``), so a module- or session-scoped
fixture's start-up is charged to the first test that asks for it. The output is a
function of the file: the same XML gives the same bytes (ties break on the test's id).
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "skipped")


@dataclass(frozen=True)
class Case:
    """One ``<testcase>``: its pytest id, seconds and outcome (one of :data:`OUTCOMES`)."""

    nodeid: str
    seconds: float
    outcome: str

    @property
    def file(self) -> str:
        """The test file of the id (``tests/x/test_y.py``)."""
        return self.nodeid.split("::", 1)[0]


@dataclass(frozen=True)
class Run:
    """A junit file's cases and its suites' totals (wall seconds; host and timestamp as
    pytest wrote them, empty when absent)."""

    cases: tuple[Case, ...]
    wall_s: float
    hostname: str
    timestamp: str


def _nodeid(tc: ET.Element) -> str:
    """``tests/x/test_y.py::Class::test_z[p]`` from junit's ``classname`` and ``name``.

    pytest writes ``classname`` as the dotted module path plus any classes
    (``tests.x.test_y.Class``); the module is the longest dotted prefix that names a file,
    which junit does not record, so the first component starting with ``Test`` (pytest's
    default class prefix) starts the classes."""
    if not tc.get("classname"):  # a collection error: pytest names the module only
        return tc.get("name") or "?"
    parts = (tc.get("classname") or "").split(".")
    cut = next((i for i, p in enumerate(parts) if p.startswith("Test")), len(parts))
    module = "/".join(parts[:cut]) + ".py" if cut else "?"
    return "::".join([module, *parts[cut:], tc.get("name") or "?"])


def _outcome(tc: ET.Element) -> str:
    for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        if tc.find(tag) is not None:
            return name
    return "passed"


def parse(path: Path) -> Run:
    """The run in the junit XML at ``path``; ValueError when it holds no ``<testsuite>``."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        raise ValueError(f"{path}: no <testsuite> element (not a pytest junit XML?)")
    cases = tuple(Case(_nodeid(tc), float(tc.get("time") or 0.0), _outcome(tc))
                  for s in suites for tc in s.iter("testcase"))
    return Run(cases=cases,
               wall_s=sum(float(s.get("time") or 0.0) for s in suites),
               hostname=suites[0].get("hostname") or "",
               timestamp=suites[0].get("timestamp") or "")


def merge(runs: Sequence[Run]) -> Run:
    """One run of passes that ran one after another: every case, the walls summed, the
    first pass's host and start time."""
    if not runs:
        raise ValueError("no junit file given")
    return Run(cases=tuple(c for r in runs for c in r.cases),
               wall_s=sum(r.wall_s for r in runs),
               hostname=runs[0].hostname, timestamp=runs[0].timestamp)


def _mmss(seconds: float) -> str:
    m, s = divmod(seconds, 60.0)
    return f"{int(m)}:{s:04.1f}"


def render(run: Run, top: int = 25, files: int = 10) -> str:
    """The markdown for ``run``: totals, the ``top`` slowest tests, the ``files`` slowest
    files (0 leaves a table out); ValueError on a negative count."""
    if top < 0 or files < 0:
        raise ValueError(f"top and files must be >= 0, got {top} and {files}")
    total = sum(c.seconds for c in run.cases)
    counts = {o: sum(c.outcome == o for c in run.cases) for o in OUTCOMES}
    where = ", ".join(x for x in (run.hostname, run.timestamp) if x) or "not recorded"
    lines = [
        f"{len(run.cases)} tests: " + ", ".join(f"{n} {o}" for o, n in counts.items() if n)
        + f"; wall {run.wall_s:.1f} s ({_mmss(run.wall_s)}), sum of test times "
        + f"{total:.1f} s; run: {where}",
    ]
    if top:
        slow = sorted(run.cases, key=lambda c: (-c.seconds, c.nodeid))[:top]
        lines += ["", f"Slowest {len(slow)} tests:", "",
                  "| # | test | seconds | share | outcome |", "|---:|---|---:|---:|---|"]
        lines += [f"| {i} | `{c.nodeid}` | {c.seconds:.2f} | "
                  f"{100 * c.seconds / total if total else 0:.1f}% | {c.outcome} |"
                  for i, c in enumerate(slow, 1)]
    if files:
        per: defaultdict[str, list[float]] = defaultdict(list)
        for c in run.cases:
            per[c.file].append(c.seconds)
        slow_files = sorted(per.items(), key=lambda kv: (-sum(kv[1]), kv[0]))[:files]
        lines += ["", f"Slowest {len(slow_files)} files:", "",
                  "| # | file | tests | seconds | share |", "|---:|---|---:|---:|---:|"]
        lines += [f"| {i} | `{f}` | {len(ts)} | {sum(ts):.1f} | "
                  f"{100 * sum(ts) / total if total else 0:.1f}% |"
                  for i, (f, ts) in enumerate(slow_files, 1)]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.lib.durations",
                                 description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("junit", type=Path, nargs="+",
                    help="pytest's --junitxml files of one run, in the order they ran "
                         "(make test: build/junit.xml build/junit-serial.xml)")
    ap.add_argument("--top", type=int, default=25, help="slowest tests to list (default 25)")
    ap.add_argument("--files", type=int, default=10, help="slowest files to list (default 10)")
    a = ap.parse_args(argv)
    try:
        sys.stdout.write(render(merge([parse(p) for p in a.junit]), top=a.top, files=a.files))
    except (OSError, ET.ParseError, ValueError) as e:
        print(f"durations: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
