"""One coordinator per local store, leases that notice a restart, and an arena that is
reserved or refused (issue 31, items 1 and 4), each fault mounted for real: kill -9 of
the coordinator under a read lease, a stopped coordinator with a full listen backlog, a
second coordinator started by hand, a tmpfs too small for the arena."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import ERR_NOT_FOUND, ERR_UNAVAILABLE, OK, StoreUnavailable, open_store
from kvcentric.store.local import launcher, ownership
from kvcentric.store.local.client import LocalStore
from kvcentric.store.local.config import socket_path
from kvcentric.testing.signals import sigstop
from tests.helpers.payload import payload, size_of
from tests.helpers.waiting import wait_until
from tests.store.store_contract import get, put, run_worker


def as_dict(cfg: StoreConfig) -> dict[str, object]:
    return {"name": cfg.name, "capacity_bytes": cfg.local.capacity_bytes,
            "runtime_dir": str(cfg.local.runtime_dir), "hot_timeout_s": cfg.hot_timeout_s}


def coordinators(cfg: StoreConfig) -> list[int]:
    """Pids of the processes serving ``cfg``'s store (its coordinator command line)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        named = any(f'"name": "{cfg.name}"'.encode() in part for part in cmd) or any(
            a == b"--name" and b == cfg.name.encode() for a, b in zip(cmd, cmd[1:]))
        if b"kvcentric.store.local.server" in cmd and named \
                and launcher.pid_alive(int(d.name)):
            pids.append(int(d.name))
    return pids


def lease_bytes(ptr: int, size: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr)).copy()


@pytest.fixture
def stopped(store_cfg: StoreConfig) -> Iterator[tuple[LocalStore, int]]:
    """A client of a store whose coordinator is SIGSTOPped (SIGCONT at teardown)."""
    s = open_store(store_cfg)
    assert isinstance(s, LocalStore)
    pid = s.stats()["pid"]
    sigstop(pid)
    try:
        yield s, pid
    finally:
        os.kill(pid, signal.SIGCONT)
        s.close()


def test_restart_under_a_read_lease_never_serves_its_bytes(store_cfg: StoreConfig) -> None:
    """kill -9 the coordinator while this client holds a read lease; another process
    autostarts a new one and writes. The new generation maps a fresh arena, so the leased
    bytes are untouched (and stay mapped after the client moves on), but the lease reports
    invalid; the old key is a miss in the new store, never the old bytes."""
    cfg = store_cfg.with_(reconnect_interval_s=0.1)
    store = open_store(cfg)
    assert isinstance(store, LocalStore)
    try:
        assert put(store, ["old"]) == [OK]
        lease = store.batch_acquire(["old"])
        assert lease.keys == ["old"] and store.lease_valid(lease)
        pid = store.stats()["pid"]
        (old_arena,) = ownership.generation_files(cfg, "arena")
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: not launcher.pid_alive(pid), 10)
        assert not store.lease_valid(lease)  # its coordinator is gone
        # the writer's keys fill the arena from offset 0, where "old" was
        news = [f"new/{i}" for i in range(8)]
        assert run_worker(as_dict(cfg), "put", *news) == [OK] * len(news)
        (new_arena,) = ownership.generation_files(cfg, "arena")
        assert new_arena != old_arena  # a fresh file; the dead one was unlinked
        assert not store.lease_valid(lease)
        assert np.array_equal(lease_bytes(lease.ptrs[0], lease.sizes[0]),
                              payload("old", size_of("old")))
        # this client reconnects (in the background) to the new generation
        assert wait_until(lambda: store.batch_exists(news) == len(news), 10)
        buf = np.zeros(size_of("old"), np.uint8)
        assert store.batch_get_into(["old"], [buf.ctypes.data], [buf.nbytes]) == \
            [ERR_NOT_FOUND]
        assert all(b is not None and np.array_equal(b, payload(k, b.nbytes))
                   for k, b in zip(news, get(store, news)))
        # the old mapping outlived the reconnect for the lease's sake
        assert np.array_equal(lease_bytes(lease.ptrs[0], lease.sizes[0]),
                              payload("old", size_of("old")))
        store.release(lease)
        assert not store.lease_valid(lease)
    finally:
        store.close()


def test_dropped_connection_invalidates_its_leases_before_reuse(
        store_cfg: StoreConfig) -> None:
    """The coordinator drops a client (here: a frame it cannot parse, sent on the
    client's own connection): every lease of that connection is invalid before another
    client can reserve its bytes; the client reconnects and reads again."""
    cfg = store_cfg.with_(reconnect_interval_s=0.1, capacity_bytes=1 << 20)
    store = open_store(cfg)
    other = open_store(cfg)
    assert isinstance(store, LocalStore)
    try:
        assert put(store, ["held"]) == [OK]
        lease = store.batch_acquire(["held"])
        s = store._link.session
        assert s is not None and s.rpc._sock is not None
        s.rpc._sock.sendall(b"\xff\xff\xff\x7f")  # a frame claiming 2 GiB: dropped
        assert wait_until(lambda: not store.lease_valid(lease), 5)
        # the coordinator reclaimed the lease: a writer may now evict "held" and reuse it
        assert put(other, [f"fill/{i}" for i in range(16)]).count(OK) >= 1
        store.release(lease)
        assert wait_until(lambda: put(store, ["again"]) == [OK], 10)
    finally:
        other.close()
        store.close()


def _fill_backlog(cfg: StoreConfig) -> list[socket.socket]:
    """Connect until the stopped coordinator's listen backlog is full (a connect would
    block): what a swamped coordinator looks like to a launcher."""
    socks = []
    for _ in range(4096):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        socks.append(s)
        if s.connect_ex(str(socket_path(cfg))) in (errno.EAGAIN, errno.EWOULDBLOCK):
            return socks
    raise AssertionError("the listen backlog never filled")


def test_a_stopped_coordinator_keeps_the_store(store_cfg: StoreConfig,
                                               stopped: tuple[LocalStore, int]) -> None:
    """SIGSTOP the coordinator and fill its backlog, so it looks dead to a connect: no
    launcher, CLI or hand-started coordinator starts a second one on its files; it serves
    again after SIGCONT."""
    store, pid = stopped
    socks = _fill_backlog(store_cfg)
    try:
        assert not launcher.is_running(store_cfg)
        with pytest.raises(StoreUnavailable, match=f"pid {pid}"):
            launcher.ensure_running(store_cfg)
        direct = subprocess.run(
            [sys.executable, "-m", "kvcentric.store.local.server", "--config-json",
             json.dumps(as_dict(store_cfg))], capture_output=True, text=True, timeout=60)
        assert direct.returncode == 2
        assert f"already has a coordinator (pid {pid}" in direct.stderr
        cli = subprocess.run(
            [sys.executable, "-m", "kvcentric.cli", "store", "serve", "--name",
             store_cfg.name, "--runtime-dir", str(store_cfg.local.runtime_dir)],
            capture_output=True, text=True, timeout=60)
        assert cli.returncode == 1 and f"pid {pid}" in cli.stderr
        assert coordinators(store_cfg) == [pid] and ownership.holder(store_cfg) == pid
    finally:
        for s in socks:
            s.close()
    os.kill(pid, signal.SIGCONT)
    assert wait_until(lambda: put(store, ["after"]) == [OK], 10)
    assert store.stats()["pid"] == pid and coordinators(store_cfg) == [pid]


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                           str(path)], capture_output=True).returncode == 0


def test_a_full_tmpfs_refuses_to_start_with_a_clear_message(tmp_path: Path) -> None:
    """The arena is reserved at start: on a tmpfs without room the coordinator refuses,
    naming the path and the sizes, and every client gets ``StoreUnavailable`` (never a
    SIGBUS on a later write); with room again, it starts and writes succeed."""
    shm = tmp_path / "shm"
    mounted = _mount_tmpfs(shm, "24m")
    if mounted:  # a real small tmpfs, to be mostly filled by someone else's file
        capacity = 16 << 20
    else:  # no mount here: an arena larger than the free space of /dev/shm
        st = os.statvfs("/dev/shm")
        capacity = st.f_bavail * st.f_frsize + (1 << 30)
    cfg = StoreConfig.from_dict({"name": f"full{uuid.uuid4().hex[:6]}", "capacity_bytes": capacity,
                                 "runtime_dir": shm if mounted else Path("/dev/shm") / shm.name,
                                 "prefault": False})
    try:
        if mounted:
            (shm / "filler").write_bytes(bytes(16 << 20))
        with pytest.raises(StoreUnavailable) as exc:
            open_store(cfg)
        msg = str(exc.value)
        assert f"cannot reserve {capacity} B" in msg and str(cfg.local.runtime_dir) in msg
        assert "free of" in msg and "No space left on device" in msg
        # what to do: the filler holds the room; an arena larger than all of /dev/shm
        assert (("other files hold 16 MiB" in msg and "remove them" in msg) if mounted
                else "the file system is smaller than the arena" in msg), msg
        assert not launcher.is_running(cfg) and not ownership.generation_files(cfg, "arena")
        late = open_store(cfg, required=False)  # an engine starts without its store
        assert late.batch_exists(["a"]) == 0 and put(late, ["a"]) == [ERR_UNAVAILABLE]
        late.close()
        if not mounted:  # the claim's second half needs a tmpfs of our own to free
            pytest.skip("refusal checked on /dev/shm; the start once there is room needs "
                        "a tmpfs mount (root)")
        if mounted:
            (shm / "filler").unlink()
            with open_store(cfg) as store:
                data = np.full(capacity - (1 << 20), 7, np.uint8)  # nearly the whole arena
                assert store.batch_put_from(["big"], [data.ctypes.data], [data.nbytes]) == [OK]
                (b,) = get_bytes(store, "big", data.nbytes)
                assert b is not None and np.array_equal(b, data)
                pid = store.stats()["pid"]
            launcher.stop(cfg)
            assert wait_until(lambda: not launcher.pid_alive(pid), 10)
    finally:
        if mounted:
            wait_until(lambda: not coordinators(cfg), 10)
            subprocess.run(["umount", str(shm)], check=True)
        else:
            shutil.rmtree(Path("/dev/shm") / shm.name, ignore_errors=True)


def test_an_arena_larger_than_its_tmpfs_says_what_to_do(tmp_path: Path) -> None:
    """The start-up check on a /dev/shm smaller than the configured arena (a container's
    64 MiB default, say): the coordinator refuses at once, and the message names the
    arena's path, its size, the file system's, and what to do (shrink the store below
    the file system's size, or enlarge it: --shm-size, a Memory emptyDir, another
    runtime_dir)."""
    shm = tmp_path / "shm"
    if not _mount_tmpfs(shm, "8m"):
        pytest.skip("cannot mount a tmpfs here")
    cfg = StoreConfig.from_dict({"name": f"big{uuid.uuid4().hex[:6]}", "capacity_bytes": 16 << 20,
                                 "runtime_dir": shm, "prefault": False})
    try:
        with pytest.raises(StoreUnavailable) as exc:
            open_store(cfg)
        msg = str(exc.value)
        assert f"cannot reserve {16 << 20} B (16 MiB) for the store's arena at {shm}/" in msg
        assert f"free of {8 << 20} B on {shm}" in msg, msg
        assert "the file system is smaller than the arena: lower the store capacity " \
               "below 8 MiB or enlarge it" in msg, msg
        assert "--shm-size" in msg and "medium: Memory" in msg and "runtime_dir" in msg
        assert not launcher.is_running(cfg) and not ownership.generation_files(cfg, "arena")
    finally:
        wait_until(lambda: not coordinators(cfg), 10)
        subprocess.run(["umount", str(shm)], check=True)


def test_a_restart_fits_a_tmpfs_sized_for_one_arena(tmp_path: Path) -> None:
    """kill -9 the coordinator of a store whose tmpfs holds one arena and a bit: the dead
    generation's pages are freed (its file unlinked by the next coordinator, its mapping
    dropped by the client before it starts one), so the restart fits."""
    shm = tmp_path / "shm"
    if not _mount_tmpfs(shm, "20m"):
        pytest.skip("cannot mount a tmpfs here")
    cfg = StoreConfig.from_dict({"name": f"one{uuid.uuid4().hex[:6]}", "capacity_bytes": 16 << 20,
                                 "runtime_dir": shm, "reconnect_interval_s": 0.1,
                                 "hot_timeout_s": 1.0})
    try:
        with open_store(cfg) as store:
            assert put(store, ["a"]) == [OK]
            pid = store.stats()["pid"]
            os.kill(pid, signal.SIGKILL)
            assert wait_until(lambda: not launcher.pid_alive(pid), 10)
            assert put(store, ["b"]) == [ERR_UNAVAILABLE]  # the breaker opens ...
            assert wait_until(lambda: put(store, ["b"]) == [OK], 20)  # ... and it restarts
            assert store.stats()["pid"] != pid and store.batch_exists(["a"]) == 0
            pid = store.stats()["pid"]
        launcher.stop(cfg)
        assert wait_until(lambda: not launcher.pid_alive(pid), 10)
    finally:
        wait_until(lambda: not coordinators(cfg), 10)
        subprocess.run(["umount", str(shm)], check=True)


def test_a_coordinator_whose_runtime_dir_is_removed_exits(tmp_path: Path) -> None:
    """No client can reach a coordinator whose socket path is gone: once its last client
    leaves, it exits (no orphan, whatever idle_timeout_s says)."""
    cfg = StoreConfig.from_dict({"name": "gone", "capacity_bytes": 16 << 20,
                                 "runtime_dir": tmp_path / "rt", "prefault": False})
    with open_store(cfg) as store:
        pid = store.stats()["pid"]
        shutil.rmtree(cfg.local.runtime_dir)
        assert put(store, ["still"]) == [OK]  # connected clients keep being served
    assert wait_until(lambda: not launcher.pid_alive(pid), 10)


def get_bytes(store: object, key: str, size: int) -> list[np.ndarray | None]:
    assert isinstance(store, LocalStore)
    buf = np.zeros(size, np.uint8)
    got = store.batch_get_into([key], [buf.ctypes.data], [size])
    return [buf if got == [size] else None]
