"""Where the benchmarks live and write, and how one benchmark starts another as a process.

``ROOT`` is the repository; ``RESULTS`` the committed results (``benchmarks/results/``);
``LOGS`` their gitignored scratch (servers' logs and configs). :func:`module_command`
is the command line of ``python -m <module>``, and :func:`module_env` an environment in
which it imports ``benchmarks.*`` from any working directory (the repository on
``PYTHONPATH``; no process edits ``sys.path``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
LOGS = RESULTS / "logs"


def module_command(module: str, *args: str) -> list[str]:
    """``[python, -m, module, *args]`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def module_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the repository first on ``PYTHONPATH``."""
    out = dict(os.environ if env is None else env)
    rest = out.get("PYTHONPATH")
    out["PYTHONPATH"] = str(ROOT) + (os.pathsep + rest if rest else "")
    return out
