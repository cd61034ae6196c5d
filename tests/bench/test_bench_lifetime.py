"""A benchmark killed with SIGTERM still runs its cleanup (``benchmarks.lib.lifetime``)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from benchmarks.lib.paths import ROOT

SCRIPT = """
import sys, time
from benchmarks.lib.lifetime import stop_on_sigterm
if sys.argv[2] == "on":
    stop_on_sigterm()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    open(sys.argv[1], "w").write("stopped")
"""


def _run(tmp_path: Path, mode: str) -> tuple[int, bool]:
    marker = tmp_path / f"cleanup-{mode}"
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, str(marker), mode], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    return p.wait(timeout=30), marker.exists()


def test_sigterm_runs_the_benchmarks_cleanup(tmp_path: Path) -> None:
    assert _run(tmp_path, "on") == (143, True)
    # without it the process just dies: what left a fleet run's store arena behind
    assert _run(tmp_path, "off") == (-signal.SIGTERM, False)
