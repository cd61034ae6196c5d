"""kvcentric.testing.signals: a SIGSTOP that returns only once its target has stopped, which
the hung-store tests rely on to assert what a stopped process cannot do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvcentric.testing.signals import group_members, sigstop, sigstop_group, thread_states

# a process with several threads, each spinning on the CPU: none is parked in the kernel,
# so each must be interrupted to stop. "up" is one write(2) of a whole line: two spinners
# share a pipe in test_a_group_stops_as_a_whole, and print() unbuffered (PYTHONUNBUFFERED)
# writes the text and its newline apart, which interleaved as "upup\n", "\n" in a run
SPINNER = """
import os, threading
def spin():
    while True:
        pass
for _ in range(3):
    threading.Thread(target=spin, daemon=True).start()
os.write(1, b"up\\n")
spin()
"""


@pytest.fixture
def spinner() -> Iterator[subprocess.Popen[str]]:
    p = subprocess.Popen([sys.executable, "-c", SPINNER], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "up\n"
        yield p
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_every_thread_is_stopped_when_sigstop_returns(
        spinner: subprocess.Popen[str]) -> None:
    assert len(thread_states(spinner.pid)) == 4
    sigstop(spinner.pid)
    try:
        assert set(thread_states(spinner.pid)) <= {"T", "t"}
    finally:
        os.kill(spinner.pid, signal.SIGCONT)
    # the control: resumed, its spinning threads run again (the states can differ)
    assert any(s == "R" for _ in range(2000) for s in thread_states(spinner.pid))


def test_a_group_stops_as_a_whole() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys\n"
         f"c = subprocess.Popen([sys.executable, '-c', {SPINNER!r}])\n"
         f"exec({SPINNER!r})"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert parent.stdout is not None
        assert [parent.stdout.readline() for _ in range(2)] == ["up\n"] * 2
        members = group_members(parent.pid)
        assert parent.pid in members and len(members) == 2
        sigstop_group(parent.pid)
        try:
            for pid in members:
                assert set(thread_states(pid)) <= {"T", "t"}
        finally:
            os.killpg(parent.pid, signal.SIGCONT)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_a_process_that_cannot_stop_is_resumed_and_named(
        spinner: subprocess.Popen[str]) -> None:
    """A traced thread, or one stuck in the kernel, may not stop in time: the caller gets
    a ``TimeoutError`` naming it, and the process is left running, not half-stopped. A
    zero timeout mounts that: the check runs once, before the threads have stopped."""
    with pytest.raises(TimeoutError, match=str(spinner.pid)) as info:
        for _ in range(200):  # a stop can complete before the first check: try again
            sigstop(spinner.pid, timeout=0.0)
            os.kill(spinner.pid, signal.SIGCONT)
    assert "still ran" in str(info.value)
    assert any(s == "R" for _ in range(2000) for s in thread_states(spinner.pid))


def test_a_gone_process_is_an_error() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    with pytest.raises(ProcessLookupError):
        sigstop(p.pid)
    assert thread_states(p.pid) == []
