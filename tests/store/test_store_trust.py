"""A second local user against the local store: runtime dirs, files and peers (issue 32).

Every attack is mounted for real by ``nobody`` (tests/helpers/other_user.py): it creates
the runtime dir first (world-writable, group-writable, a symlink), plants files and runs
its own coordinator there, connects to our socket, or listens on a socket our runtime dir
points to. The bar: the coordinator refuses to start (a non-zero exit naming the path, its
owner and its mode), clients get ``StoreUnavailable`` with that message and engines
recompute (misses, ``ERR_UNAVAILABLE``), nothing of ours is written into the other user's
directory and no byte of ours reaches its process; a connection from another user is
dropped while ours are served.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import ERR_UNAVAILABLE, OK, StoreUnavailable, open_store
from kvcentric.store.local import launcher, ownership
from kvcentric.store.local.client import LocalStore
from kvcentric.store.local.config import socket_path
from tests.helpers import other_user
from tests.helpers.waiting import wait_until
from tests.store.store_contract import get, put

pytestmark = pytest.mark.skipif(other_user.reason() is not None,
                                reason=other_user.reason() or "")
SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


@pytest.fixture
def spot() -> Iterator[Path]:
    """A fresh name in the world-writable /dev/shm (where the default runtime dirs live);
    whatever anyone made there is removed afterwards."""
    p = SHM / f"kvc-atk-{uuid.uuid4().hex[:10]}"
    yield p
    for q in (p, p.with_name(p.name + "-theirs")):
        if q.is_symlink() or q.is_file():
            q.unlink()
        elif q.exists():
            shutil.rmtree(q, ignore_errors=True)


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A directory of ours that other users may traverse (``0711``): a runtime dir in it
    is reachable by ``nobody`` only where the test loosens its modes on purpose."""
    p = SHM / f"kvc-sec-{uuid.uuid4().hex[:10]}"
    p.mkdir(mode=0o711)
    p.chmod(0o711)
    yield p
    shutil.rmtree(p, ignore_errors=True)


def cfg_at(runtime_dir: Path, **kw: object) -> StoreConfig:
    return StoreConfig.from_dict({"name": f"t{uuid.uuid4().hex[:8]}", "capacity_bytes": 8 << 20,
                                  "runtime_dir": runtime_dir, "hot_timeout_s": 1.0,
                                  "start_timeout_s": 30.0, **kw})


def as_nobody(code: str, group: str = "nogroup") -> str:
    return other_user.python(code, group).stdout


def serve(cfg: StoreConfig) -> subprocess.CompletedProcess[str]:
    """``kvcentric store serve`` in the foreground (it exits at once when it refuses)."""
    return subprocess.run([sys.executable, "-m", "kvcentric.cli", "store", "serve", "--name",
                           cfg.name, "--runtime-dir", str(cfg.local.runtime_dir), "--capacity",
                           "8mb"], capture_output=True, text=True, timeout=60)


def assert_refused_everywhere(cfg: StoreConfig, *words: str) -> None:
    """The store cannot be used: clients and ``store serve`` refuse with ``words`` in the
    message; an engine's client (``required=False``) misses and recomputes."""
    with pytest.raises(StoreUnavailable) as err:
        LocalStore(cfg)
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    engine = open_store(cfg, required=False)
    try:
        assert engine.batch_exists(["a"]) == 0
        assert put(engine, ["a"]) == [ERR_UNAVAILABLE]
        assert get(engine, ["a"]) == [None]
    finally:
        engine.close()
    out = serve(cfg)
    assert out.returncode != 0, out
    for w in words:
        assert w in out.stderr, (w, out.stderr)


def fake_as_nobody(runtime_dir: Path, name: str, log: Path, sock: Path | None = None
                   ) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "tests.helpers.fake_coordinator", "--runtime-dir",
            str(runtime_dir), "--name", name, "--log", str(log)]
    proc = other_user.popen(argv + (["--socket", str(sock)] if sock else []))
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


# ---- the runtime dir ----
def test_a_runtime_dir_another_user_made_first_is_refused(spot: Path) -> None:
    """nobody creates the runtime dir first (world-writable), plants an arena and runs its
    own coordinator there: refused by name, owner and mode; no client ever connects to
    it and nothing of ours is created in it."""
    cfg = cfg_at(spot)
    as_nobody(f"import os; os.mkdir({str(spot)!r}); os.chmod({str(spot)!r}, 0o777)")
    log = spot / "fake.log"
    fake = fake_as_nobody(spot, cfg.name, log)
    try:
        planted = sorted(os.listdir(spot))
        assert_refused_everywhere(cfg, str(spot), "not owned by", "nobody (uid 65534)",
                                  "mode 0o777")
        assert sorted(os.listdir(spot)) == planted  # no lock, owner, log or arena of ours
        assert not log.exists()  # it logs every connection: no client ever reached it
    finally:
        fake.kill()
        fake.wait()


@pytest.mark.parametrize("target", ["theirs", "ours"])
def test_a_symlinked_runtime_dir_is_refused(spot: Path, target: str) -> None:
    """The runtime dir's name is a symlink nobody made, to its own directory or to a good
    one of ours: a symlink is never followed."""
    cfg = cfg_at(spot)
    theirs = spot.with_name(spot.name + "-theirs")
    if target == "theirs":
        as_nobody(f"import os; os.mkdir({str(theirs)!r}, 0o700); "
                  f"os.symlink({str(theirs)!r}, {str(spot)!r})")
    else:
        theirs.mkdir(mode=0o700)  # ours, and fine as a runtime dir
        as_nobody(f"import os; os.symlink({str(theirs)!r}, {str(spot)!r})")
    assert_refused_everywhere(cfg, str(spot), "it is a symlink")
    assert os.listdir(theirs) == []


@pytest.mark.parametrize("who", ["nobody", "us"])
def test_a_group_writable_runtime_dir_is_refused(spot: Path, who: str) -> None:
    cfg = cfg_at(spot)
    if who == "nobody":
        as_nobody(f"import os; os.mkdir({str(spot)!r}); os.chmod({str(spot)!r}, 0o775)")
        assert_refused_everywhere(cfg, str(spot), "nobody (uid 65534)", "mode 0o775")
    else:
        spot.mkdir(mode=0o700)
        spot.chmod(0o770)
        assert_refused_everywhere(cfg, str(spot), "writable by group or others",
                                  "mode 0o770")
    assert os.listdir(spot) == []


def test_a_new_runtime_dir_is_private(spot: Path) -> None:
    cfg = cfg_at(spot)
    with open_store(cfg) as s:
        assert put(s, ["k"]) == [OK]
        assert (spot.stat().st_mode & 0o777) == 0o700
        for f in spot.iterdir():  # socket, lock, owner, token, arena, index, log
            assert f.stat().st_mode & 0o077 == 0, (f, oct(f.stat().st_mode))
    launcher.stop(cfg)


# ---- files ----
@pytest.mark.parametrize("how", ["file of nobody", "symlink"])
def test_a_swapped_arena_is_refused(spot: Path, how: str) -> None:
    """The current generation's arena is replaced under a running store (by another user
    with write access to the directory; here root moves nobody's file in): an engine that
    connects now refuses to map it, one that mapped the real one keeps working."""
    cfg = cfg_at(spot)
    first = open_store(cfg)
    try:
        assert put(first, ["a"]) == [OK]
        arena = ownership.generation_files(cfg, "arena")[0]
        theirs = spot.with_name(spot.name + "-theirs")
        as_nobody(f"import os; f = open({str(theirs)!r}, 'wb'); f.truncate({8 << 20})")
        moved = arena.with_name("real-arena")
        arena.rename(moved)  # the real one stays alive for the first engine
        if how == "symlink":
            arena.symlink_to(theirs)
            words = ["it is a symlink"]
        else:
            os.rename(theirs, arena)
            words = ["not owned by", "nobody (uid 65534)"]
        with pytest.raises(StoreUnavailable) as err:
            LocalStore(cfg)
        assert str(arena) in str(err.value) and all(w in str(err.value) for w in words)
        second = open_store(cfg, required=False)
        assert second.batch_exists(["a"]) == 0 and put(second, ["b"]) == [ERR_UNAVAILABLE]
        second.close()
        maps = Path("/proc/self/maps").read_text()
        assert str(theirs) not in maps and f"{arena} " not in maps.replace(" (deleted)", "")
        assert get(first, ["a"])[0] is not None  # the first engine's mapping is the real one
    finally:
        first.close()
        launcher.stop(cfg)


# ---- peers ----
def _nobody_says_hello(sock: Path, group: str = "nogroup") -> str:
    """nobody connects to ``sock``, says hello and reports what came back."""
    return as_nobody(f"""
import socket
from kvcentric.store.local import wire
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
try:
    s.connect({str(sock)!r})
except OSError as exc:
    print("unreachable", exc.errno); raise SystemExit
try:
    s.sendall(wire.encode(["hello"]))
    print("reply", type(wire.recv_frame(s)).__name__)
except (EOFError, BrokenPipeError, ConnectionResetError):  # closed before or after
    print("closed")
""", group).strip()


@pytest.mark.parametrize("peer_group", [None, "nogroup"])
def test_a_connection_from_another_user_is_dropped(reachable: Path,
                                                   peer_group: str | None) -> None:
    """The socket is made reachable on purpose (dir 0711, socket 0666): ``SO_PEERCRED``
    still drops a peer of another user (and not of the peer group, when there is one)
    before it reads a byte, while our clients are served by the same coordinator."""
    cfg = cfg_at(reachable / "rt", peer_group=peer_group)
    with open_store(cfg) as ours:
        assert put(ours, ["a"]) == [OK]
        pid = ours.stats()["pid"]
        cfg.local.runtime_dir.chmod(0o711)
        socket_path(cfg).chmod(0o666)
        assert _nobody_says_hello(socket_path(cfg), group="daemon") == "closed"
        assert get(ours, ["a"])[0] is not None
        st = ours.stats()
        assert st["pid"] == pid and st["refused_peers"] == 1
        assert ownership.generation_files(cfg, "arena")  # its arena is still there
    launcher.stop(cfg)


def test_a_peer_group_member_uses_the_store_but_cannot_administer_it(reachable: Path) -> None:
    """With ``peer_group``, the runtime dir (0710), socket, arena (0660) and index (0640)
    are the group's to use: nobody in that group puts and gets through its own client
    (a runtime dir and files of root's, which it trusts by group), but cannot read the
    0600 admin token, so clear and stop are refused and a long pin is cut to max_pin_s."""
    cfg = cfg_at(reachable / "rt", peer_group="nogroup")
    with open_store(cfg) as ours:
        assert put(ours, ["a"]) == [OK]
        assert oct(cfg.local.runtime_dir.stat().st_mode & 0o7777) == "0o710"
        raw = {"name": cfg.name, "runtime_dir": str(cfg.local.runtime_dir),
               "peer_group": "nogroup", "capacity_bytes": cfg.local.capacity_bytes,
               "hot_timeout_s": 1.0}
        out = as_nobody(f"""
import json, numpy as np
from kvcentric.store import StoreUnavailable, open_store
from kvcentric.store.local import launcher
from kvcentric.config import StoreConfig
from tests.store.store_contract import get, put
cfg = StoreConfig.from_dict({raw!r})
res = {{}}
with open_store(cfg) as s:
    res["put"] = put(s, ["b"])
    res["get_a"] = get(s, ["a"])[0] is not None
    slots = s.batch_alloc(["c"], [4096])
    res["long_pin"] = s.batch_commit([x for x in slots if x], pin_s=600.0)
    for name, call in (("clear", s.clear), ("stop", lambda: launcher.stop(cfg))):
        try:
            call()
            res[name] = "done"
        except StoreUnavailable as exc:
            res[name] = str(exc)
print(json.dumps(res))
""")
        res = json.loads(out.strip().splitlines()[-1])
        assert res["put"] == [OK] and res["get_a"] and res["long_pin"] == [OK]
        assert "token" in res["clear"] and "token" in res["stop"], res
        assert get(ours, ["b"])[0] is not None and ours.batch_exists(["a", "b"]) == 2
    launcher.stop(cfg)


def test_a_coordinator_of_another_user_is_refused(spot: Path, tmp_path: Path) -> None:
    """Our runtime dir's socket name leads (a symlink) to a coordinator nobody runs: the
    client checks ``SO_PEERCRED`` of what it connected to and refuses before it sends a
    byte."""
    theirs = spot.with_name(spot.name + "-theirs")
    as_nobody(f"import os; os.mkdir({str(theirs)!r}, 0o755)")
    log = theirs / "fake.log"
    cfg = cfg_at(tmp_path / "rt", autostart=False)
    cfg.local.runtime_dir.mkdir(mode=0o700)
    fake = fake_as_nobody(theirs, cfg.name, log, sock=theirs / "fake.sock")
    try:
        socket_path(cfg).symlink_to(theirs / "fake.sock")
        with pytest.raises(StoreUnavailable, match="runs as nobody"):
            LocalStore(cfg)
        # the fake logs the client's hang-up after all it received: wait for that
        assert wait_until(lambda: log.exists() and "closed" in log.read_text().split(), 10)
        assert log.read_text().split() == ["connection", "closed"]  # connected, said nothing
    finally:
        fake.kill()
        fake.wait()
