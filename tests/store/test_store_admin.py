"""The local coordinator's admin token and pin caps, on a real coordinator (issue 32).

Clear, shutdown and pins longer than ``max_pin_s`` need the token the coordinator writes
``0600`` next to its socket: a raw connection that asks without it (or with a wrong one)
gets an error naming the token's file and is closed, and nothing else happens; our own
tools (the local client, ``launcher.stop``, ``kvcentric store stop``) read it and pass.
Pins are capped per connection: past ``max_pinned_bytes`` an object is committed
unpinned (``pins_refused``), and a connection's pins lapse when it closes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import OK, StoreUnavailable, open_store
from kvcentric.store.local import gate, launcher, ownership, wire
from kvcentric.store.local.client import LocalStore
from kvcentric.store.local.config import socket_path, token_path
from tests.store.store_contract import put

MB = 1 << 20
OBJ = 4 * MB  # the test store (64 MiB) holds 16


@pytest.fixture
def store(store_cfg: StoreConfig) -> Iterator[LocalStore]:
    s = open_store(store_cfg)
    assert isinstance(s, LocalStore)
    put(s, ["a", "b"], [None, "a"])
    yield s
    s.close()


def _raw(cfg: StoreConfig) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(str(socket_path(cfg)))
    return sock


def _refused_then_closed(sock: socket.socket, request: list[object]) -> str:
    """Send ``request``; the error it got (the connection must then be closed)."""
    sock.sendall(wire.encode(request))
    reply = wire.recv_frame(sock)
    assert isinstance(reply, list) and reply[0] == "error", reply
    with pytest.raises((EOFError, ConnectionResetError)):
        wire.recv_frame(sock)
    return str(reply[1])


@pytest.mark.parametrize("request_", [["clear"], ["shutdown"], ["auth", "0" * 64]],
                         ids=["clear", "shutdown", "a wrong token"])
def test_admin_ops_without_the_token_close_only_that_connection(
        request_: list[object], store: LocalStore, store_cfg: StoreConfig) -> None:
    pid = store.stats()["pid"]
    arena = ownership.generation_files(store_cfg, "arena")
    why = _refused_then_closed(_raw(store_cfg), request_)
    assert str(token_path(store_cfg)) in why and "token" in why
    assert store.batch_exists(["a", "b"]) == 2  # nothing cleared, not shut down
    assert store.stats()["pid"] == pid and launcher.is_running(store_cfg)
    assert ownership.generation_files(store_cfg, "arena") == arena


def test_a_long_pin_without_the_token_is_refused(store: LocalStore,
                                                 store_cfg: StoreConfig) -> None:
    sock = _raw(store_cfg)
    sock.sendall(wire.encode(["reserve", ["p"], [4096], [None]]))
    assert wire.recv_frame(sock)[0] >= 0
    why = _refused_then_closed(sock, ["commit", ["p"], [None], 600.0])
    assert "600 s" in why and "max_pin_s" in why
    assert store.batch_exists(["p"]) == 0  # never committed; its slot was reclaimed
    sock = _raw(store_cfg)
    sock.sendall(wire.encode(["commit", ["p"], [None], 1e9]))  # past MAX_PIN_S: nobody may
    assert wire.recv_frame(sock)[0] == "error"
    sock.close()


def test_with_the_token_admin_ops_work(store: LocalStore, store_cfg: StoreConfig) -> None:
    st = os.stat(token_path(store_cfg), follow_symlinks=False)
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()
    sock = _raw(store_cfg)
    sock.sendall(wire.encode(["auth", gate.read_token(store_cfg)]))
    assert wire.recv_frame(sock) is True
    sock.sendall(wire.encode(["clear"]))
    assert wire.recv_frame(sock) == 2
    sock.close()
    put(store, ["c"])
    assert store.clear() == 1  # the local client presents the token itself
    slots = [s for s in store.batch_alloc(["long"], [4096]) if s is not None]
    assert store.batch_commit(slots, pin_s=600.0) == [OK]  # a long pin, with the token
    assert store.stats()["pinned"] == 1


def test_stop_reads_the_token_and_refuses_a_planted_one(store_cfg: StoreConfig) -> None:
    s = open_store(store_cfg)
    s.close()
    token = token_path(store_cfg)
    real = token.read_text()
    planted = token.with_name("elsewhere")
    planted.write_text(real)
    token.unlink()
    token.symlink_to(planted)  # a symlink is never read, even to the right token
    with pytest.raises(StoreUnavailable, match="symlink"):
        launcher.stop(store_cfg)
    cli = subprocess.run([sys.executable, "-m", "kvcentric.cli", "store", "stop", "--name",
                          store_cfg.name, "--runtime-dir", str(store_cfg.local.runtime_dir)],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 1 and "symlink" in cli.stderr
    assert launcher.is_running(store_cfg)
    token.unlink()
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, real.encode())
    os.close(fd)
    cli = subprocess.run([sys.executable, "-m", "kvcentric.cli", "store", "stop", "--name",
                          store_cfg.name, "--runtime-dir", str(store_cfg.local.runtime_dir)],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and "stopped" in cli.stdout
    assert not launcher.is_running(store_cfg) and not token.exists()


# ---- pinned bytes ----
def _commit(store: LocalStore, keys: list[str], pin_s: float = 0.0) -> list[int]:
    slots = [s for s in store.batch_alloc(keys, [OBJ] * len(keys)) if s is not None]
    for s in slots:
        np.frombuffer((np.ctypeslib.as_ctypes_type(np.uint8) * s.size).from_address(s.ptr),
                      np.uint8)[:] = 1
    return store.batch_commit(slots, pin_s)


def _flood(store: LocalStore, tag: str, n: int = 40) -> None:
    for i in range(n):
        _commit(store, [f"{tag}-{i}"])


def test_pinned_bytes_are_capped_per_connection(store_cfg: StoreConfig) -> None:
    """A cap of two objects: of four pinned commits two are pinned and survive a flood,
    two are refused their pins (committed, then evicted like any object); another
    connection has its own budget; a connection's pins lapse when it closes."""
    cfg = store_cfg.with_(max_pinned_bytes=2 * OBJ)
    one, two = open_store(cfg), open_store(cfg)
    assert isinstance(one, LocalStore) and isinstance(two, LocalStore)
    try:
        assert _commit(one, ["p0", "p1", "p2", "p3"], pin_s=30) == [OK] * 4
        st = one.stats()
        assert st["pinned"] == 2 and st["pins_refused"] == 2
        assert _commit(two, ["q0", "q1", "q2"], pin_s=30) == [OK] * 3
        st = two.stats()
        assert st["pinned"] == 4 and st["pins_refused"] == 3
        _flood(two, "f")
        assert [one.batch_exists([k]) for k in ("p0", "p1", "p2", "p3")] == [1, 1, 0, 0]
        assert two.batch_exists(["q0"]) + two.batch_exists(["q1"]) == 2
        one.close()  # its pins lapse with its connection
        _flood(two, "g")
        assert two.batch_exists(["p0"]) + two.batch_exists(["p1"]) == 0
        assert two.batch_exists(["q0"]) + two.batch_exists(["q1"]) == 2
    finally:
        one.close()
        two.close()
