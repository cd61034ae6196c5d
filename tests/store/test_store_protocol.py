"""The local coordinator's socket under garbage and hostile peers, and read-lease TTLs.

Every case talks to a real coordinator over its real Unix socket. The bar: a bad peer
gets an error or a closed connection; the coordinator never crashes, never runs what it
was sent, keeps its arena, and keeps serving everyone else while it happens. A frame that
cannot be decoded or is not a request (too big, too deep, garbage, values of the wrong
shape) closes its connection; a request whose arguments have the wrong types gets an
error. Admin operations without the token: tests/store/test_store_admin.py.
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import ERR_HAS_LEASE, OK, open_store
from kvcentric.store.local import ownership, wire
from kvcentric.store.local.client import LocalStore
from kvcentric.store.local.config import socket_path
from tests.store.store_contract import get, put


@pytest.fixture
def store(store_cfg: StoreConfig) -> Iterator[LocalStore]:
    s = open_store(store_cfg.with_(shared_index=False))  # every lookup hits the socket
    assert isinstance(s, LocalStore)
    put(s, ["a", "b"], [None, "a"])
    yield s
    s.close()


def _raw(cfg: StoreConfig) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(str(socket_path(cfg)))
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        while sock.recv(1 << 16):
            pass  # an error reply may come first
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {MARKER}",))


MARKER = Path("/tmp") / f"kvc-pwned-{os.getpid()}"


def _payload(frame: bytes) -> bytes:
    return struct.pack("<I", len(frame)) + frame


HOSTILE = {
    # a whole frame of seeded random bytes: unseeded, its first 4 bytes (the length) were
    # at most MAX_FRAME once in 64 runs, and the coordinator rightly waited for the rest of
    # that frame (a half frame: test_a_stalled_half_frame_...); a length above MAX_FRAME
    # is "a frame claiming 2 GiB"
    "random bytes": _payload(random.Random(0).randbytes(4092)),
    "a pickle that runs a command": _payload(pickle.dumps(_Evil())),
    "a frame claiming 2 GiB": struct.pack("<I", 2 << 30) + b"x" * 100,
    "a msgpack map, not a request": wire.encode({"op": "exists"}),
    "a request whose op is a number": wire.encode([7, ["a"]]),
    "truncated msgpack": _payload(msgspec.msgpack.encode(["exists", ["a", "b"]])[:-3]),
    # msgspec decodes recursively: this raised RecursionError, which killed the coordinator
    # and removed its arena (issue 32)
    "200 KB of nested arrays": _payload(b"\x91" * 200_000 + b"\xc0"),
    "nested maps": _payload(b"\x81\xa1k" * 70_000 + b"\xc0"),
    "nested arrays inside a request": _payload(  # ["exists", [[[[...]]]]]
        b"\x92" + msgspec.msgpack.encode("exists") + b"\x91" * 100_000 + b"\xc0"),
    "an array claiming 4 billion items": _payload(b"\xdd\xff\xff\xff\xff\xc0"),
    "a map as an argument": wire.encode(["exists", {"a": 1}]),
    "bytes as an argument": wire.encode(["exists", b"ab"]),
    "a list of lists as an argument": wire.encode(["exists", [["a"]]]),
    "an empty request": wire.encode([]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_frames_close_the_connection_and_nothing_else(
        case: str, store: LocalStore, store_cfg: StoreConfig) -> None:
    pid = store.stats()["pid"]
    arena = ownership.generation_files(store_cfg, "arena")
    other = _raw(store_cfg)  # a well-behaved connection open meanwhile
    sock = _raw(store_cfg)
    try:
        sock.sendall(HOSTILE[case])
    except BrokenPipeError:
        pass  # closed before it finished sending
    assert _closed_by_peer(sock), f"{case}: the coordinator kept a garbage connection open"
    sock.close()
    assert not MARKER.exists(), "a frame ran code in the coordinator"
    assert store.batch_exists(["a", "b"]) == 2  # same coordinator, still serving
    assert store.stats()["pid"] == pid
    assert ownership.generation_files(store_cfg, "arena") == arena and arena[0].exists()
    other.sendall(wire.encode(["exists", ["a", "b"]]))  # only the hostile one was closed
    assert wire.recv_frame(other) == 2
    other.close()


def test_bad_requests_get_errors_and_the_connection_lives(store: LocalStore,
                                                          store_cfg: StoreConfig) -> None:
    sock = _raw(store_cfg)
    for req in (["no-such-op"], ["exists"], ["exists", 5], ["acquire", [1, 2]],
                ["reserve", ["k"], ["big"], [None]], ["residency", "ab"], ["residency", [1]],
                ["residency", ["a"], ["b"]]):
        sock.sendall(wire.encode(req))
        reply = wire.recv_frame(sock)
        assert isinstance(reply, list) and reply[0] == "error", (req, reply)
    sock.sendall(wire.encode(["exists", ["a", "b"]]))
    assert wire.recv_frame(sock) == 2
    sock.sendall(wire.encode(["residency", ["a", "b", "zz"]]))  # no disk tier: all in DRAM
    assert wire.recv_frame(sock) == [2, []]
    sock.close()


def test_a_stalled_half_frame_does_not_block_other_clients(store: LocalStore,
                                                           store_cfg: StoreConfig) -> None:
    sock = _raw(store_cfg)
    sock.sendall(struct.pack("<I", 1000) + b"\x93")  # promises 1000 B, sends 1
    t0 = time.monotonic()
    for _ in range(20):
        assert store.batch_exists(["a", "b"]) == 2
    assert time.monotonic() - t0 < 2.0
    sock.close()


def test_a_client_that_never_reads_is_dropped_not_waited_for(store: LocalStore,
                                                             store_cfg: StoreConfig) -> None:
    """Thousands of list requests and not one reply read: the coordinator queues what the
    socket will not take, drops the client past its bound, and answers others meanwhile."""
    sock = _raw(store_cfg)
    sock.setblocking(False)
    req = wire.encode(["keys", "", 1000])
    t0 = time.monotonic()
    sent = 0
    while time.monotonic() - t0 < 3.0:
        try:
            sock.send(req)
            sent += 1
        except BlockingIOError:
            assert store.batch_exists(["a", "b"]) == 2
            time.sleep(0.01)
        except (BrokenPipeError, ConnectionResetError):
            break
    assert store.batch_exists(["a", "b"]) == 2
    assert sent > 100
    sock.close()


def test_leases_expire_after_their_ttl(store_cfg: StoreConfig) -> None:
    """A client that takes a lease and hangs: after ``lease_ttl_s`` the coordinator
    reclaims it, the object is removable again, the holder sees its lease as lapsed, and
    its late release changes nothing."""
    cfg = store_cfg.with_(lease_ttl_s=1.0)
    hung = open_store(cfg)
    other = open_store(cfg)
    put(hung, ["x"])
    lease = hung.batch_acquire(["x"])
    assert hung.lease_valid(lease) and other.remove("x") == ERR_HAS_LEASE
    deadline = time.monotonic() + 5
    while other.stats()["leases"] and time.monotonic() < deadline:
        time.sleep(0.1)
    stats = other.stats()
    assert stats["leases"] == 0 and stats["expired_leases"] == 1
    assert not hung.lease_valid(lease)
    assert other.remove("x") == OK
    hung.release(lease)  # late: harmless
    put(other, ["y"])
    assert get(hung, ["y"])[0] is not None
    hung.close()
    other.close()
