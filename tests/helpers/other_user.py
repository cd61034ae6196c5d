"""A second local user for tests that mount attacks for real: commands run as ``nobody``.

Root drops to ``nobody`` with ``setpriv --reuid nobody --regid GROUP --clear-groups``
(``su`` needs a login shell, which ``nobody`` lacks). :func:`reason` says why a test
process cannot (it is not root, or ``setpriv``/``nobody`` is missing): tests skip with it
(a fact about this test process, so ``KVC_NO_SKIPS`` lets the skip stand).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOBODY = "nobody"


def reason() -> str | None:
    """Why this process cannot act as a second user, or None."""
    if os.geteuid() != 0:
        return "this test process is not root: it cannot act as a second user (nobody)"
    if shutil.which("setpriv") is None:
        return "this machine has no setpriv to act as a second user"
    try:
        pwd.getpwnam(NOBODY)
    except KeyError:
        return "this machine has no user nobody"
    return None


def uid() -> int:
    return pwd.getpwnam(NOBODY).pw_uid


def command(argv: Sequence[str], group: str = "nogroup") -> list[str]:
    """``argv`` run as ``nobody`` with primary group ``group`` and no other groups."""
    return ["setpriv", "--reuid", NOBODY, "--regid", group, "--clear-groups", *argv]


def python(code: str, group: str = "nogroup", timeout: float = 60.0,
           check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``python -c code`` as ``nobody`` (the repository importable); its output."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT),
           "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/tmp"}
    out = subprocess.run(command([sys.executable, "-c", code], group), capture_output=True,
                         text=True, timeout=timeout, cwd="/", env=env)
    if check and out.returncode != 0:
        raise AssertionError(f"as nobody: exit {out.returncode}\n{out.stdout}\n{out.stderr}")
    return out


def popen(argv: Sequence[str], group: str = "nogroup") -> subprocess.Popen[str]:
    """Start ``argv`` as ``nobody`` (the repository importable), stdout piped."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT),
           "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/tmp"}
    return subprocess.Popen(command(argv, group), stdout=subprocess.PIPE, text=True, cwd="/",
                            env=env)
