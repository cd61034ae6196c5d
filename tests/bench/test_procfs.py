"""benchmarks/lib/procfs.py's CPU readers and ``quiesce``, on real processes that burn CPU."""

from __future__ import annotations

import select
import subprocess
import sys
from collections.abc import Iterator

import pytest

from benchmarks.lib import procfs
from tests.helpers.waiting import wait_until

# busy for BUSY_S seconds of wall time, then asleep (a vLLM worker polling after a request);
# it says "busy" on stdout when its spell starts and "idle" when it is over
# serial (tests/helpers/xdist_groups.py): it measures a process's CPU share against wall time
pytestmark = pytest.mark.serial

BURN = "import time,sys\nprint('busy', flush=True)\nt=time.time()\n" \
       "while time.time()-t<float(sys.argv[1]): pass\nprint('idle', flush=True)\n" \
       "time.sleep(60)"


@pytest.fixture
def burner() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _start(procs: list[subprocess.Popen[bytes]], busy_s: float) -> int:
    p = subprocess.Popen([sys.executable, "-c", BURN, str(busy_s)], start_new_session=True,
                         stdout=subprocess.PIPE, bufsize=0)  # unbuffered: select sees each line
    procs.append(p)
    return p.pid


def _said(p: subprocess.Popen[bytes], word: str) -> bool:
    """True when ``p``'s next line, there now, is ``word`` (False: no line yet)."""
    assert p.stdout is not None
    if not select.select([p.stdout], [], [], 0)[0]:
        return False
    line = p.stdout.readline()
    assert line == f"{word}\n".encode(), line
    return True


def _idle(p: subprocess.Popen[bytes]) -> bool:
    """True once ``p`` said its busy spell is over (it prints, then sleeps)."""
    return _said(p, "idle")


def test_group_cpu_seconds_counts_a_busy_group(burner: list[subprocess.Popen[bytes]]) -> None:
    pgid = _start(burner, 60.0)
    assert procfs.group_pids(pgid) == [pgid]
    assert wait_until(lambda: _said(burner[0], "busy"), 30)
    assert wait_until(lambda: procfs.group_cpu_seconds([pgid]) > 0.1, 30)
    assert procfs.group_cpu_seconds([]) == 0.0


def test_quiesce_waits_out_a_busy_spell_and_no_longer(
        burner: list[subprocess.Popen[bytes]]) -> None:
    """quiesce returns once the groups are idle, not before and not much later. Every
    bound is an event or a margin of seconds: a quiet group is let go within a few of
    quiesce's 0.1 s windows, a busy one only after it said it is idle, and a group busy
    for ever at the timeout (never before it; after it by less than the 60 s it would
    otherwise be busy)."""
    quiet = _start(burner, 0.0)
    assert wait_until(lambda: _said(burner[0], "busy"), 30)
    assert wait_until(lambda: _idle(burner[0]), 30)  # its interpreter's start-up is over
    assert procfs.quiesce([quiet], timeout_s=30) < 3.0
    busy = _start(burner, 1.0)
    assert wait_until(lambda: _said(burner[1], "busy"), 30)  # its spell has begun
    waited = procfs.quiesce([quiet, busy], timeout_s=30)
    # let go only after the spell ended: it had said so by then (it prints, then sleeps)
    assert _idle(burner[1]), waited
    assert waited < 30, waited  # not at the timeout: once it was idle
    forever = _start(burner, 60.0)
    assert wait_until(lambda: _said(burner[2], "busy"), 30)
    waited = procfs.quiesce([forever], timeout_s=0.5)
    assert 0.5 <= waited < 5.0, waited
    assert not _idle(burner[2])  # it is still busy: the timeout, not the group, ended it
