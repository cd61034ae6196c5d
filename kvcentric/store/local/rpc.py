"""Client side of the coordinator protocol: msgpack frames over a Unix socket (see
:mod:`kvcentric.store.local.wire`).

Thread-safe: one request in flight per connection. A call that times out closes the
connection (a late reply would desynchronise the stream) and raises ``StoreUnavailable``;
the coordinator then reclaims that connection's leases and pending writes.
"""

from __future__ import annotations

import select
import socket
import threading
from pathlib import Path
from typing import Any

from kvcentric.store.base import StoreUnavailable
from kvcentric.store.local import wire


class RpcClient:
    """One connection to a coordinator. ``generation`` changes on every reconnect."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.generation = 0
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout_s)
        try:
            s.connect(str(self.path))
        except OSError as exc:
            s.close()
            raise StoreUnavailable(f"cannot reach store at {self.path}: {exc}") from exc
        self.generation += 1
        return s

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def peer_alive(self) -> bool:
        """Connected, and the coordinator has not closed its end (it died or stopped):
        one non-blocking ``poll``, no round trip. Safe while another thread is in a call."""
        sock = self._sock
        if sock is None:
            return False
        try:
            p = select.poll()
            p.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
            if not p.poll(0):
                return True
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except (OSError, ValueError):  # closed under us by another thread
            return False

    def call(self, op: str, *args: Any) -> Any:
        """Send one request and wait for its reply (at most ``timeout_s`` per read)."""
        frame = wire.encode([op, *args])
        with self._lock:
            if self._sock is None:
                self._sock = self._connect()
            sock = self._sock
            try:
                sock.sendall(frame)
                reply = wire.recv_frame(sock)
            except (OSError, EOFError, wire.ProtocolError) as exc:
                # socket.timeout is an OSError: the reply did not come in time
                self._close_locked()
                raise StoreUnavailable(f"store op {op!r} failed: {exc}") from exc
        if isinstance(reply, list) and len(reply) == 2 and reply[0] == "error":
            raise ValueError(f"store rejected {op!r}: {reply[1]}")
        return reply

    def send(self, op: str, *args: Any) -> None:
        """Send a request that gets no reply (the coordinator handles it in order)."""
        frame = wire.encode([op, *args])
        with self._lock:
            if self._sock is None:
                return  # nothing to tell a coordinator we are no longer connected to
            try:
                self._sock.sendall(frame)
            except OSError:
                self._close_locked()

    def _close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
