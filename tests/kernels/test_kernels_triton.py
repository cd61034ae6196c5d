"""Run ``tests/kernels/test_kernels.py`` against the Triton kernels on CPU.

Triton reads ``TRITON_INTERPRET`` when it is imported, so the interpreter run
needs a fresh process: this test starts pytest on ``test_kernels.py`` in a
subprocess with ``TRITON_INTERPRET=1``, where every data test exercises
``impl="triton"``. Skipped when Triton is missing or the current process
already runs under the interpreter (``test_kernels.py`` then covers Triton).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcentric import kernels

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")
@pytest.mark.skipif(kernels.triton_interpret_enabled(),
                    reason="this test process already runs Triton's interpreter")
def test_kernels_under_triton_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-x",
        str(ROOT / "tests" / "kernels" / "test_kernels.py"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"interpreter run failed:\n{tail}"
    assert " passed" in proc.stdout, tail


def test_import_does_not_load_triton() -> None:
    code = "import sys, kernels; assert 'triton' not in sys.modules, 'triton imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
