""".ci/cleanup-run ends what a run started when the run is interrupted: here a server in
a session of its own whose child renamed itself the way vLLM's engine processes do
(setproctitle, which overwrites the environment /proc shows, so the run's marker in it is
gone), mounted for real and interrupted with SIGTERM as CI cancels a run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]

SERVER = '''
import json, os, signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", """
import os, signal, setproctitle
setproctitle.setproctitle("VLLM::EngineCore")
open(os.environ["OUT"] + ".child", "w").write(str(os.getpid()))
signal.pause()
"""])
open(os.environ["OUT"] + ".server", "w").write(json.dumps([os.getpid(), child.pid]))
signal.pause()
'''

RUN = '''
import os, signal, subprocess, sys
subprocess.Popen([sys.executable, "-c", os.environ["SERVER"]], start_new_session=True)
signal.pause()
'''


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_an_interrupted_run_ends_renamed_engine_processes(tmp_path: Path) -> None:
    out = tmp_path / "pids"
    env = {**os.environ, "OUT": str(out), "SERVER": SERVER}
    run = subprocess.Popen([str(ROOT / ".ci" / "cleanup-run"), sys.executable, "-c", RUN],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    server_file, child_file = Path(f"{out}.server"), Path(f"{out}.child")
    try:
        assert wait_until(lambda: server_file.exists() and child_file.exists(), 60), \
            "the server and its child never started"
        server, child = json.loads(server_file.read_text())
        # the premise: the server is marked, its renamed child no longer shows the marker
        assert b"KVC_TEST_RUN=kvc-run-" in Path(f"/proc/{server}/environ").read_bytes()
        assert b"KVC_TEST_RUN=" not in Path(f"/proc/{child}/environ").read_bytes()
        assert os.getpgid(child) == os.getpgid(server) == server  # its own session
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
        assert wait_until(lambda: not alive(server) and not alive(child), 30), \
            f"left running after cleanup: server {alive(server)}, child {alive(child)}"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        if server_file.exists():  # what a failed cleanup left: not for the next test
            for pid in json.loads(server_file.read_text()):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


LEAK = '''
import mmap, os, signal, sys
for name in sys.argv[1:]:  # made, mapped, never unlinked: as a killed vLLM engine leaves them
    fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    mmap.mmap(fd, 4096)
os.kill(os.getpid(), signal.SIGKILL)
'''

HOLD = '''
import mmap, os, sys
fd = os.open("/dev/shm/" + sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
os.close(fd)
print("held", flush=True)
sys.stdin.read()
'''


def test_a_run_removes_the_shared_memory_its_killed_engines_left(tmp_path: Path) -> None:
    """vLLM's engines leave their shared-memory queues and semaphores in /dev/shm when a
    test kills them; the run removes those its processes made, and only those: a segment
    older than the run, or one a live process outside the run still maps, stays."""
    tag = f"{os.getpid()}_{tmp_path.name}"[-40:].replace("-", "_")
    leaked = [f"psm_{tag}", f"vllm_{tag}-cpushm", f"sem.mp-{tag}"]
    older, held = Path(f"/dev/shm/psm_{tag}_older"), f"psm_{tag}_held"
    older.write_bytes(b"\0" * 16)  # before the run: not its own
    os.utime(older, (1, 1))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, held], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        # mapped by a process outside the run, and dated after its start like its own
        future = time.time() + 3600
        os.utime(f"/dev/shm/{held}", (future, future))
        run = subprocess.run([str(ROOT / ".ci" / "cleanup-run"), sys.executable, "-c",
                              LEAK, *leaked], capture_output=True, text=True, timeout=60)
        # the run's command was killed, as engines are: 128 + SIGKILL
        assert run.returncode == 128 + signal.SIGKILL, run.stdout + run.stderr
        assert [n for n in leaked if Path("/dev/shm", n).exists()] == []
        assert older.exists() and Path("/dev/shm", held).exists()
    finally:
        holder.communicate("", timeout=30)
        for n in (*leaked, held, older.name):
            Path("/dev/shm", n).unlink(missing_ok=True)
