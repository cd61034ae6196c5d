"""Is a change within noise of its base? One benchmark, run alternately on two commits.

    python -m benchmarks.lib.alternate --base REF [--head REF] [--rounds 3] [--name NAME] \\
        -- benchmarks.micro.store --quick

Checks both commits out in detached worktrees (under ``/tmp``, removed afterwards; the head
defaults to ``HEAD``, so edits in the working tree during a run change nothing) and runs the
benchmark module with its arguments in each, alternately: round ``i`` runs the base
first when ``i`` is even and this tree first when it is odd, so a drift of the machine over
the run (another job, a warming page cache) lands on both sides alike. Each run writes its
own JSON (``--out`` into a scratch dir; the module must take ``--out``) and this reads the
numeric fields of its ``summary`` (nested ones as ``outer.inner``). Each side runs with its
own tree first on ``PYTHONPATH`` and as its working directory, and the first run of each
side checks that it imported ``kvcentric`` from its own tree.

Writes ``results/alternate_<name>.json``: per summary field, each side's values, median and
range, the ratio of the medians (this tree over the base) and ``overlap`` (the two ranges
intersect: parity at this many rounds, as the benchmarks' rule says).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS, ROOT, module_env

CHECK = "import kvcentric, sys; print(kvcentric.__file__)"


def worktree(ref: str, where: Path) -> str:
    """Check ``ref`` out at ``where`` (detached); returns its full commit id."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(where), sha], cwd=ROOT,
                   check=True)
    return sha


def side_env(tree: Path) -> dict[str, str]:
    """This process's environment with ``tree`` first on ``PYTHONPATH``."""
    env = module_env()
    rest = [p for p in env["PYTHONPATH"].split(":") if p and Path(p) != ROOT]
    env["PYTHONPATH"] = ":".join([str(tree), *rest])
    return env


def imports_from(tree: Path) -> Path:
    """Where a Python started as a side is started imports ``kvcentric`` from."""
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=tree, env=side_env(tree),
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out).resolve()


def run_once(tree: Path, module: str, args: list[str], out: Path,
             timeout_s: float) -> dict[str, float]:
    """One run of ``module`` in ``tree``; the numeric fields of its result's ``summary``."""
    cmd = [sys.executable, "-m", module, *args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tree, env=side_env(tree), capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} in {tree} exited {proc.returncode}:\n"
                           f"{proc.stderr[-3000:]}")
    return numeric(json.loads(out.read_text()).get("summary") or {})


def numeric(summary: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of ``summary``, a nested object's as ``outer.inner`` (e.g. a value per
    prompt size); booleans and everything else left out."""
    out: dict[str, float] = {}
    for k, v in summary.items():
        if isinstance(v, dict):
            out.update(numeric(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[prefix + k] = float(v)
    return out


def compare(base: list[dict[str, float]], head: list[dict[str, float]]) -> dict[str, Any]:
    """Per field both sides have in every round: values, medians, ranges, ratio, overlap."""
    fields = sorted(set.intersection(*(set(r) for r in base + head)))
    out: dict[str, Any] = {}
    for f in fields:
        b, h = [r[f] for r in base], [r[f] for r in head]
        mb, mh = statistics.median(b), statistics.median(h)
        out[f] = {"base": b, "head": h, "base_median": mb, "head_median": mh,
                  "base_range": [min(b), max(b)], "head_range": [min(h), max(h)],
                  "head_over_base": mh / mb if mb else None,
                  "overlap": max(min(b), min(h)) <= min(max(b), max(h))}
    return out


def _cell(median: float, lo: float, hi: float) -> str:
    return f"{median:.4g} [{lo:.4g}, {hi:.4g}]"


def table(fields: dict[str, Any]) -> str:
    lines = [f"{'field':<34} {'base median [range]':>30} {'head median [range]':>30} "
             f"{'head/base':>9} overlap"]
    for f, r in fields.items():
        ratio = "-" if r["head_over_base"] is None else f"{r['head_over_base']:.3f}"
        lines.append(f"{f:<34} {_cell(r['base_median'], *r['base_range']):>30} "
                     f"{_cell(r['head_median'], *r['head_range']):>30} {ratio:>9} "
                     f"{r['overlap']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m benchmarks.lib.alternate --base REF [--rounds N] "
              "[--name NAME] -- MODULE [ARGS...]", file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare against")
    ap.add_argument("--head", default="HEAD", help="the commit compared (default: HEAD)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default=None, help="default: the module's last part")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--out", default=None, help="default: results/alternate_<name>.json")
    args = ap.parse_args(argv[:cut])
    module, margs = argv[cut + 1], argv[cut + 2:]
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    name = args.name or module.rsplit(".", 1)[-1] + ("_quick" if "--quick" in margs else "")
    scratch = Path(tempfile.mkdtemp(prefix="kvc-alternate-"))
    trees = {"base": scratch / "base", "head": scratch / "head"}
    try:
        shas = {side: worktree(ref, trees[side])
                for side, ref in (("base", args.base), ("head", args.head))}
        for tree in trees.values():
            got = imports_from(tree)
            if not got.is_relative_to(tree.resolve()):
                raise RuntimeError(f"a run in {tree} imports kvcentric from {got}")
        runs: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
        order = []
        for i in range(args.rounds):
            sides = ("base", "head") if i % 2 == 0 else ("head", "base")
            for side in sides:
                print(f"round {i + 1}/{args.rounds}: {side}", flush=True)
                runs[side].append(run_once(trees[side], module, margs, scratch / f"{side}{i}.json",
                                           args.timeout))
                order.append(side)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    fields = compare(runs["base"], runs["head"])
    doc = {"benchmark": "alternate", "module": module, "module_args": margs,
           "base": shas["base"], "head": shas["head"], "rounds": args.rounds, "order": order,
           "fields": fields,
           "summary": {"fields": len(fields),
                       "fields_overlapping": sum(r["overlap"] for r in fields.values())}}
    out = Path(args.out) if args.out else RESULTS / f"alternate_{name}.json"
    rw.write(out, doc, table=table(fields), command=rw.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
