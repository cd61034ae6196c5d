"""A process that has imported vLLM's API server once and forks each engine start from it.

Starting a vLLM OpenAI server on the CPU is mostly imports: the API server process imports
vLLM, then spawns an EngineCore process that imports it again. A session that starts
dozens of engines (the test suite) pays the first import once here instead (then
freezes the heap, so the forks' garbage collections skip what it imported): each start is
a fork of this process that runs the server's own entry point
(``vllm.entrypoints.launchers.api_server.entry.main``, what ``python -m
vllm.entrypoints.openai.api_server`` runs) with the engine's argv, environment, working
directory and log, as the leader of a new session, stdin closed: what
``subprocess.Popen(..., start_new_session=True)`` would have started, one import
earlier, and in the network namespace of the calling thread (a test that starts an
engine inside a private namespace, next to Mooncake). With vLLM's own entry the
engine still spawns its EngineCore fresh, with the engine's environment; with
``FORKING_VLLM_ENTRY`` (:mod:`kvcentric.testing.vllm_forking`) it forks that too. Values
vLLM reads from the environment at import time come from the zygote's (the session's).

The server (``python -m kvcentric.testing.zygote SOCKET [--entry MODULE:FUNCTION]``)
answers one JSON line per connection on a Unix socket in a directory only its owner can
enter: ``{"op": "fork", "argv", "env", "cwd", "log", "netns"}`` -> ``{"pid"}`` (``netns``:
null, or the ``/proc`` path of the caller's thread's network namespace), and
``{"op": "status", "pid"}`` -> ``{"returncode"}`` (null while the process runs; negative
for a signal, as :class:`subprocess.Popen` reports it). It reaps its children, and exits
when the process that started it is gone; the engines it forked are left to their owners.

:class:`Zygote` is the client side: it starts the server on the first :meth:`Zygote.fork`
and hands out :class:`ForkedProcess`, a :class:`subprocess.Popen` for a process this
process did not fork (``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvcentric.testing.netns import setns_net

VLLM_ENTRY = "vllm.entrypoints.launchers.api_server.entry:main"
# the same server with its EngineCore and worker processes forked from it, not spawned
# (kvcentric.testing.vllm_forking): what a session that starts many engines uses
FORKING_VLLM_ENTRY = "kvcentric.testing.vllm_forking:main"
# a request line is an engine's argv and environment: generous, but bounded
MAX_REQUEST = 1 << 20


def _load(entry: str) -> Callable[[], Any]:
    module, _, name = entry.partition(":")
    fn: Callable[[], Any] = getattr(importlib.import_module(module), name)
    return fn


def _child(req: Mapping[str, Any], entry: Callable[[], Any], close: Sequence[socket.socket],
           netns: int | None) -> None:
    """In the forked child: become the engine described by ``req`` (in the network
    namespace open at ``netns``, if any); never returns."""
    code = 1
    try:
        for s in close:
            s.close()
        if netns is not None:
            setns_net(netns)
            os.close(netns)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT
                          else signal.default_int_handler)
        os.setsid()
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = list(req["argv"])
        entry()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # the engine's own crash: in its log, as an unforked one's would be
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _check(req: Any) -> dict[str, Any]:
    """``req`` as a fork request, or ``ValueError``."""
    if not isinstance(req, dict):
        raise ValueError("a request is a JSON object")
    argv, env, cwd, log = req.get("argv"), req.get("env"), req.get("cwd"), req.get("log")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise ValueError("argv: a non-empty list of strings")
    if not (isinstance(env, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError("env: an object of strings")
    if not (isinstance(cwd, str) and isinstance(log, str)):
        raise ValueError("cwd and log: strings")
    netns = req.get("netns")
    if netns is not None and not (isinstance(netns, str) and netns.startswith("/proc/")
                                  and netns.endswith("/ns/net")):
        raise ValueError("netns: null or a /proc/.../ns/net path")
    return req


def _read_line(conn: socket.socket, limit: int | None = None) -> bytes:
    """One newline-ended message from ``conn``; ``ValueError`` when the peer closes first
    or it grows past ``limit`` bytes."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ValueError("the connection closed before a whole line")
        if limit is not None and len(data) + len(chunk) > limit:
            raise ValueError(f"a message is one JSON line of at most {limit} bytes")
        data += chunk
    return data


def serve(path: Path, entry: Callable[[], Any]) -> None:
    """Answer requests on the Unix socket ``path`` until the parent process is gone."""
    owner = os.getppid()
    done: dict[int, int] = {}  # pid -> Popen-style return code, for every reaped child
    forked: set[int] = set()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staging = path.with_name(path.name + ".binding")
    staging.unlink(missing_ok=True)
    sock.bind(str(staging))
    sock.listen(16)
    os.rename(staging, path)  # the path appears only once a connect succeeds
    while os.getppid() == owner:
        while forked:  # reap: a child's status is kept for its owner's next poll
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            forked.discard(pid)
            done[pid] = os.waitstatus_to_exitcode(status)
        if not select.select([sock], [], [], 0.1)[0]:
            continue
        conn, _ = sock.accept()
        with conn:
            conn.settimeout(10)
            try:
                req = json.loads(_read_line(conn, MAX_REQUEST))
                if isinstance(req, dict) and req.get("op") == "status":
                    pid = int(req["pid"])
                    code = done.get(pid)
                    if code is None and pid not in forked:
                        raise ValueError(f"pid {pid} was not forked here")
                    answer: dict[str, Any] = {"returncode": code}
                else:
                    req = _check(req)
                    # opened here, while the caller waits for the answer (and so is still
                    # in that namespace); the child joins it before anything else
                    netns = (os.open(req["netns"], os.O_RDONLY)
                             if req.get("netns") else None)
                    sys.stdout.flush()
                    sys.stderr.flush()
                    try:
                        pid = os.fork()
                        if pid == 0:
                            _child(req, entry, (sock, conn), netns)
                    finally:
                        if netns is not None:
                            os.close(netns)
                    forked.add(pid)
                    answer = {"pid": pid}
            except (ValueError, KeyError, TypeError, OSError) as exc:
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            try:
                conn.sendall(json.dumps(answer).encode() + b"\n")
            except OSError:
                pass


def _request(path: Path, req: Mapping[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(json.dumps(req).encode() + b"\n")
        try:
            data = _read_line(s)
        except ValueError as exc:
            raise RuntimeError(f"the zygote at {path}: {exc}") from None
    answer: dict[str, Any] = json.loads(data)
    if "error" in answer:
        raise RuntimeError(f"the zygote refused: {answer['error']}")
    return answer


class ForkedProcess(subprocess.Popen[bytes]):
    """A process a :class:`Zygote` forked, behind :class:`subprocess.Popen`'s interface:
    ``pid``, ``args``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``,
    ``kill``. Its status comes from the zygote, which reaps it; no pipes."""

    def __init__(self, zygote: Zygote, pid: int, args: Sequence[str]) -> None:
        # Popen.__init__ would start a process: set what its other methods read instead
        self.args = list(args)
        self.pid = pid
        self.returncode: Any = None
        self.stdin = self.stdout = self.stderr = None
        self._child_created = False  # Popen.__del__ reaps only what it forked
        self._waitpid_lock = threading.Lock()
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.status(self.pid)
        code: int | None = self.returncode
        return code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


class Zygote:
    """Client of a zygote server on ``socket_path``, started by this object on first use
    (with this process's environment) and stopped by :meth:`close`. ``entry`` is the
    function each fork runs (default: vLLM's API server)."""

    def __init__(self, socket_path: Path, log: Path, entry: str = VLLM_ENTRY) -> None:
        self.path, self.log, self.entry = socket_path, log, entry
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def _ensure(self, timeout: float = 300.0) -> None:
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                return
            if self.proc is not None:
                raise RuntimeError(f"the zygote exited with {self.proc.returncode}; "
                                   f"log: {self.log}")
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.path.unlink(missing_ok=True)
            with open(self.log, "ab") as out:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "kvcentric.testing.zygote", str(self.path),
                     "--entry", self.entry],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + timeout
            while not self.path.exists():  # bound once the imports are done
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the zygote exited with {self.proc.returncode}; "
                                       f"log: {self.log}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the zygote did not start in {timeout} s")
                time.sleep(0.1)

    def fork(self, argv: Sequence[str], env: Mapping[str, str], log: Path,
             cwd: str | None = None) -> ForkedProcess:
        """Start ``argv`` (``argv[0]`` names the program, as in ``sys.argv``) as a fork of
        the zygote running its entry, with ``env`` as its whole environment, its output
        appended to ``log``, in ``cwd`` (default: this process's), in the calling thread's
        network namespace."""
        self._ensure()
        assert self.proc is not None
        mine = f"/proc/{os.getpid()}/task/{threading.get_native_id()}/ns/net"
        # only a namespace other than the zygote's is joined (joining one needs privileges)
        netns = (mine if os.stat(mine).st_ino != os.stat(f"/proc/{self.proc.pid}/ns/net").st_ino
                 else None)
        answer = _request(self.path, {"op": "fork", "argv": list(argv), "env": dict(env),
                                      "cwd": cwd or os.getcwd(), "log": str(log),
                                      "netns": netns})
        return ForkedProcess(self, int(answer["pid"]), argv)

    def status(self, pid: int) -> int | None:
        """The return code of forked ``pid``, None while it runs."""
        code = _request(self.path, {"op": "status", "pid": pid})["returncode"]
        return None if code is None else int(code)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.path.unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("socket", type=Path)
    ap.add_argument("--entry", default=VLLM_ENTRY)
    args = ap.parse_args(argv)
    entry = _load(args.entry)  # the imports every fork shares
    # what is alive now lives as long as the zygote: frozen, the forks' full collections
    # (vLLM's freeze_gc_heap runs one in each engine process) skip it instead of walking
    # every object the imports made, and touching it, which copies the pages they share
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    serve(args.socket, entry)


if __name__ == "__main__":
    main()
