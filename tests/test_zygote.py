"""kvcentric.testing.zygote, with a stand-in entry (tests/helpers/zygote_entry.py): a forked
start is what ``subprocess.Popen(..., start_new_session=True)`` would have started (its
argv, exactly its environment, its directory and log, a session of its own, stdin closed,
the caller's network namespace), its exit status comes back as Popen reports it, a
malformed request is refused without harm, and the zygote ends with the process that
started it. Every engine the suite starts goes through the real one (vLLM's entry, its
EngineCore forked too: kvcentric.testing.vllm_forking)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcentric.testing.netns import NetNamespace
from kvcentric.testing.servers import VllmServer
from kvcentric.testing.signals import thread_states
from kvcentric.testing.zygote import ForkedProcess, Zygote
from tests.helpers.waiting import wait_until

ENTRY = "tests.helpers.zygote_entry:main"


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    z = Zygote(tmp_path / "z" / "zygote.sock", tmp_path / "zygote.log", entry=ENTRY)
    try:
        yield z
    finally:
        z.close()


def seen(path: Path) -> dict[str, object]:
    assert wait_until(path.exists, 30), "the forked entry never ran"
    out: dict[str, object] = json.loads(path.read_text())
    return out


def test_a_fork_is_started_as_popen_would_start_it(zygote: Zygote, tmp_path: Path) -> None:
    out, log = tmp_path / "seen.json", tmp_path / "engine.log"
    log.write_text("before\n")
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = {"ONLY": "this", "PATH": os.environ["PATH"]}
    p = zygote.fork(["prog", str(out), "exit", "3"], env, log, cwd=str(workdir))
    assert isinstance(p, ForkedProcess) and isinstance(p, subprocess.Popen)
    assert p.wait(30) == 3 and p.poll() == 3 and p.returncode == 3
    got = seen(out)
    assert got["argv"] == ["prog", str(out), "exit", "3"]
    assert got["env"] == env  # exactly: nothing of the zygote's own environment
    assert got["cwd"] == str(workdir)
    assert got["pid"] == got["pgid"] == got["sid"] == p.pid  # a session of its own
    assert got["stdin"] == ""
    # the zygote's heap comes frozen: the fork's collections skip what the zygote imported
    assert isinstance(got["frozen"], int) and got["frozen"] > 1000
    assert log.read_text() == "before\nto stdout\nto stderr\n"  # appended
    assert (tmp_path / "z").stat().st_mode & 0o777 == 0o700  # only its owner connects


def test_a_fork_joins_the_network_namespace_of_the_calling_thread(
        zygote: Zygote, tmp_path: Path) -> None:
    """A test that starts an engine inside a private namespace (next to Mooncake, which
    binds every interface) gets an engine in that namespace, as a Popen from that thread
    would; outside it, the zygote's own."""
    with NetNamespace() as ns:
        with ns.entered():
            inside = zygote.fork(["prog", str(tmp_path / "in.json"), "exit", "0"], {},
                                 tmp_path / "log")
        outside = zygote.fork(["prog", str(tmp_path / "out.json"), "exit", "0"], {},
                              tmp_path / "log")
        assert inside.wait(30) == 0 and outside.wait(30) == 0
        assert seen(tmp_path / "in.json")["netns"] == os.stat(ns.path).st_ino
        assert seen(tmp_path / "out.json")["netns"] == os.stat("/proc/self/ns/net").st_ino


def test_signals_and_waits_behave_as_popens(zygote: Zygote, tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    p = zygote.fork(["prog", str(out), "block"], dict(os.environ), tmp_path / "log")
    seen(out)
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.2)
    os.killpg(p.pid, signal.SIGKILL)  # the group of the session it leads
    assert p.wait(30) == -signal.SIGKILL
    p.terminate()  # a no-op once it has exited, as Popen's
    q = zygote.fork(["prog", str(tmp_path / "q.json"), "block"], {}, tmp_path / "log")
    seen(tmp_path / "q.json")
    q.terminate()
    assert q.wait(30) == -signal.SIGTERM  # SIGTERM is not the zygote's own handler


def test_a_crash_of_the_entry_is_its_exit_status_and_its_log(
        zygote: Zygote, tmp_path: Path) -> None:
    log = tmp_path / "log"
    p = zygote.fork(["prog", str(tmp_path / "s.json"), "raise"], {}, log)
    assert p.wait(30) == 1
    assert "RuntimeError: the entry failed" in log.read_text()


def test_malformed_requests_are_refused_and_the_zygote_serves_on(
        zygote: Zygote, tmp_path: Path) -> None:
    zygote.fork(["prog", str(tmp_path / "a.json"), "exit", "0"], {}, tmp_path / "log").wait(30)

    def ask(raw: bytes) -> dict[str, object]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(str(zygote.path))
            try:
                s.sendall(raw)
                s.shutdown(socket.SHUT_WR)
            except BrokenPipeError:  # an oversize request: answered, then cut off
                pass
            answer: dict[str, object] = json.loads(s.makefile().readline())
            return answer

    for raw in (b"not json\n", b"[1, 2]\n", b'{"op": "fork", "argv": []}\n',
                b'{"op": "fork", "argv": ["a"], "env": {"K": 1}, "cwd": "/", "log": "x"}\n',
                b'{"op": "status", "pid": 1}\n', b"{" * (2 << 20), b'{"op": "fork"',
                b'{"op": "fork", "argv": ["a"], "env": {}, "cwd": "/", "log": "x", '
                b'"netns": "/etc/passwd"}\n'):
        assert "error" in ask(raw), raw
    p = zygote.fork(["prog", str(tmp_path / "b.json"), "exit", "5"], {}, tmp_path / "log")
    assert p.wait(30) == 5


def test_the_zygote_ends_with_the_process_that_started_it(tmp_path: Path) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, pathlib, signal\n"
         "from kvcentric.testing.zygote import Zygote\n"
         f"z = Zygote(pathlib.Path({str(tmp_path / 'z.sock')!r}), "
         f"pathlib.Path({str(tmp_path / 'z.log')!r}), entry={ENTRY!r})\n"
         f"z.fork(['prog', {str(tmp_path / 's.json')!r}, 'exit', '0'], {{}}, "
         f"pathlib.Path({str(tmp_path / 'log')!r})).wait(30)\n"
         "print(z.proc.pid, flush=True)\n"
         "signal.pause()\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        zpid = int(owner.stdout.readline())
        assert Path(f"/proc/{zpid}").exists()
        owner.kill()  # no close(): the zygote notices on its own
        owner.wait()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()

    # no thread left that could run (none at all once it has been reaped)
    assert wait_until(lambda: set(thread_states(zpid)) <= {"Z", "X"}, 30), \
        "the zygote outlived its owner"


@pytest.mark.vllm
def test_the_sessions_engines_fork_their_engine_core(plain_tiny: VllmServer) -> None:
    """The suite's engines come from the zygote with kvcentric.testing.vllm_forking's entry:
    the API server's EngineCore child is a fork of it (its command line is the zygote's),
    not a spawned interpreter (``python -c "from multiprocessing.spawn import ..."``)."""
    assert plain_tiny.proc is not None
    pid = plain_tiny.proc.pid
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    lines = {k: Path(f"/proc/{k}/cmdline").read_bytes().split(b"\0") for k in kids}
    mine = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"kvcentric.testing.zygote" in mine
    # the EngineCore is the server's one child (the worker runs inside it: one rank)
    assert len(kids) == 1, lines
    assert lines[kids[0]] == mine, lines
    assert not any(b"multiprocessing.spawn" in part for part in lines[kids[0]])


SEEN_BY_CHILD: list[int] = []


def test_run_forked_answers_from_a_child_that_keeps_its_side_effects() -> None:
    """vllm_forking.run_forked (vLLM's model-class inspection in the session's engines):
    the value comes back, the child's changes stay in the child, an error comes back as
    RuntimeError with the child's traceback, and a child that dies without answering is
    an error, not a hang or a None."""
    from kvcentric.testing.vllm_forking import run_forked

    def work() -> dict[str, int]:
        SEEN_BY_CHILD.append(os.getpid())
        return {"pid": os.getpid()}

    got = run_forked(work)
    assert got["pid"] != os.getpid() and SEEN_BY_CHILD == []

    def fails() -> None:
        raise KeyError("no such model class")

    with pytest.raises(RuntimeError, match="no such model class"):
        run_forked(fails)

    def dies() -> None:
        os._exit(3)

    with pytest.raises(RuntimeError, match="died before it answered"):
        run_forked(dies)
