"""SIGSTOP that returns only once the target is stopped.

``kill(pid, SIGSTOP)`` returns when the signal is queued, not when the process has
stopped: each of its threads stops on its own next way back to user space. A thread busy on
the other core, or one that a request has just woken, can still answer a call made right
after the ``kill``, and a test that asserts on what a stopped process cannot do then fails
(or passes) on the race instead of the fault. :func:`sigstop` and :func:`sigstop_group` wait
until ``/proc`` shows every thread of every target in the stopped state."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

# stopped by a signal or a tracer; a zombie or dead thread cannot answer either
_SILENT = ("T", "t", "Z", "X")


def thread_states(pid: int) -> list[str]:
    """The scheduler state letter (``/proc/<pid>/task/<tid>/stat``, field 3) of each
    thread of ``pid``; empty when the process is gone."""
    out = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread exited between the listing and the read
        # the command name (field 2) is in parentheses and may hold spaces or ')'
        out.append(stat[stat.rindex(")") + 2])
    return out


def group_members(pgid: int) -> list[int]:
    """The pids whose process group is ``pgid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid:  # state, ppid, pgrp
            out.append(int(entry.name))
    return out


def _wait_stopped(pids: list[int], timeout: float, resume: Callable[[], None]) -> None:
    deadline = time.monotonic() + timeout
    while True:
        running = [p for p in pids if any(s not in _SILENT for s in thread_states(p))]
        if not running:
            return
        if time.monotonic() > deadline:
            resume()  # a caller whose stop failed owes nothing: leave nothing half-stopped
            raise TimeoutError(f"SIGSTOP sent, but {running} still ran after {timeout} s")
        time.sleep(0.005)


def sigstop(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once all its threads are stopped (or it is gone).

    Raises ``ProcessLookupError`` when there is no such process, ``TimeoutError`` (after a
    SIGCONT) when it has not stopped within ``timeout`` s."""
    os.kill(pid, signal.SIGSTOP)
    _wait_stopped([pid], timeout, lambda: os.kill(pid, signal.SIGCONT))


def sigstop_group(pgid: int, timeout: float = 10.0) -> None:
    """SIGSTOP the process group ``pgid`` and return once every thread of each of its
    members is stopped. Raises as :func:`sigstop`."""
    os.killpg(pgid, signal.SIGSTOP)
    _wait_stopped(group_members(pgid), timeout, lambda: os.killpg(pgid, signal.SIGCONT))
