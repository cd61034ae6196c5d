"""benchmarks/lib/procfs.py's CPU readers and ``quiesce``, on real processes that burn CPU."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from benchmarks.lib import procfs

# busy for BUSY_S seconds of wall time, then asleep (a vLLM worker polling after a request)
BURN = "import time,sys\nt=time.time()\nwhile time.time()-t<float(sys.argv[1]): pass\n" \
       "time.sleep(60)"


@pytest.fixture
def burner() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _start(procs: list[subprocess.Popen[bytes]], busy_s: float) -> int:
    p = subprocess.Popen([sys.executable, "-c", BURN, str(busy_s)], start_new_session=True)
    procs.append(p)
    return p.pid


def test_group_cpu_seconds_counts_a_busy_group(burner: list[subprocess.Popen[bytes]]) -> None:
    pgid = _start(burner, 0.6)
    time.sleep(0.4)
    assert procfs.group_pids(pgid) == [pgid]
    assert procfs.group_cpu_seconds([pgid]) > 0.1
    assert procfs.group_cpu_seconds([]) == 0.0


def test_quiesce_waits_out_a_busy_spell_and_no_longer(
        burner: list[subprocess.Popen[bytes]]) -> None:
    quiet = _start(burner, 0.0)
    time.sleep(0.5)  # its interpreter's start-up is over
    assert procfs.quiesce([quiet]) < 0.5
    busy = _start(burner, 1.0)
    waited = procfs.quiesce([quiet, busy], timeout_s=10)
    assert 0.6 < waited < 3.0
    forever = _start(burner, 60.0)
    t0 = time.perf_counter()
    assert procfs.quiesce([forever], timeout_s=0.5) == pytest.approx(0.5, abs=0.3)
    assert time.perf_counter() - t0 < 1.5
