"""Client side of the coordinator protocol: pickled tuples over a Unix socket.

Thread-safe: one request in flight per connection. A call that times out closes the
connection (a late reply would desynchronise the stream) and raises ``StoreUnavailable``;
the coordinator then reclaims that connection's leases and pending writes.
"""

from __future__ import annotations

import pickle
import socket
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvcentric.store.base import StoreUnavailable


class RpcClient:
    """One connection to a coordinator. ``generation`` changes on every reconnect."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.generation = 0
        self._lock = threading.Lock()
        self._conn: Connection | None = None

    def _connect(self) -> Connection:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout_s)
        try:
            s.connect(str(self.path))
        except OSError as exc:
            s.close()
            raise StoreUnavailable(f"cannot reach store at {self.path}: {exc}") from exc
        s.settimeout(None)
        self.generation += 1
        return Connection(s.detach())

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def call(self, op: str, *args: Any) -> Any:
        """Send one request and wait for its reply (at most ``timeout_s``)."""
        with self._lock:
            if self._conn is None:
                self._conn = self._connect()
            conn = self._conn
            try:
                conn.send_bytes(pickle.dumps((op, *args), protocol=pickle.HIGHEST_PROTOCOL))
                if not conn.poll(self.timeout_s):
                    raise TimeoutError(f"store op {op!r} took over {self.timeout_s} s")
                reply = pickle.loads(conn.recv_bytes())
            except (OSError, EOFError, TimeoutError) as exc:
                self._close_locked()
                raise StoreUnavailable(f"store op {op!r} failed: {exc}") from exc
        if isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "error":
            raise ValueError(f"store rejected {op!r}: {reply[1]}")
        return reply

    def send(self, op: str, *args: Any) -> None:
        """Send a request that gets no reply (the coordinator handles it in order)."""
        with self._lock:
            if self._conn is None:
                return  # nothing to tell a coordinator we are no longer connected to
            try:
                self._conn.send_bytes(pickle.dumps((op, *args), protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:
                self._close_locked()

    def _close_locked(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
