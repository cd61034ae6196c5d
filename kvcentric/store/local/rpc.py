"""Client side of the coordinator protocol: msgpack frames over a Unix socket (see
:mod:`kvcentric.store.local.wire`).

Thread-safe: one request in flight per connection. Every call has a deadline (its own
``timeout_s``, default the client's): waiting for the connection's lock, sending and
receiving all end by it (give or take one ``poll_s``). A call that fails or runs past its
deadline closes the connection for good (a late reply would desynchronise the stream) and
raises ``StoreUnavailable``; the coordinator then reclaims that connection's leases and
pending writes. A closed client never reconnects: the owner makes a new one (so every
connection is one lease domain, see :mod:`kvcentric.store.local.session`).

The socket is blocking with ``SO_RCVTIMEO``/``SO_SNDTIMEO`` set to ``poll_s``: a round trip
is one ``send`` and (for a reply that fits one read) one ``recv`` syscall, with no ``poll``
before each as a Python socket timeout would add; a read that times out is retried until
the call's deadline.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcentric.store.base import StoreUnavailable
from kvcentric.store.local import wire

READ_CHUNK = 1 << 16  # a small reply arrives whole in one read


class RpcClient:
    """One connection to a coordinator, opened by :meth:`connect` and closed once."""

    def __init__(self, path: Path, timeout_s: float, poll_s: float | None = None) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.poll_s = min(timeout_s, poll_s or timeout_s)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = False
        self._buf = bytearray(READ_CHUNK)  # replies land here (one call at a time)
        self._queued: deque[bytes] = deque()  # one-way frames waiting for the lock

    def connect(self, check: Callable[[socket.socket], None] | None = None) -> None:
        """Connect (bounded by ``timeout_s``); ``StoreUnavailable`` when nobody answers.
        ``check`` vets the peer before a byte is sent (it raises to refuse it)."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(self.timeout_s)  # a full listen backlog blocks a connect
            s.connect(str(self.path))
            s.settimeout(None)
            tv = _timeval(self.poll_s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            if check is not None:
                check(s)
        except OSError as exc:
            s.close()
            raise StoreUnavailable(f"cannot reach store at {self.path}: {exc}") from exc
        except BaseException:
            s.close()
            raise
        with self._lock:
            if self._closed or self._sock is not None:
                s.close()
                raise StoreUnavailable("store connection already used")
            self._sock = s

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def peer_alive(self) -> bool:
        """Connected, and the coordinator has not closed its end (it died or dropped us):
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

    def call(self, op: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Send one request and wait for its reply, at most ``timeout_s`` (default the
        client's) in all; ``StoreUnavailable`` on expiry or any I/O failure."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        frame = wire.encode([op, *args])
        if not self._lock.acquire(timeout=limit):
            raise StoreUnavailable(f"store op {op!r}: connection busy for {limit} s")
        try:
            sock = self._sock
            if sock is None:
                raise StoreUnavailable(f"store op {op!r}: not connected")
            try:
                if self._queued:
                    frame = self._take_queued() + frame
                _send_all(sock, frame, deadline)
                reply = _recv_frame(sock, self._buf, deadline)
            except (OSError, EOFError, wire.ProtocolError) as exc:
                self._close_locked()
                raise StoreUnavailable(f"store op {op!r} failed: {exc or type(exc).__name__}"
                                       ) from exc
        finally:
            self._unlock()
        if isinstance(reply, list) and len(reply) == 2 and reply[0] == "error":
            raise ValueError(f"store rejected {op!r}: {reply[1]}")
        return reply

    def send(self, op: str, *args: Any) -> None:
        """Send a request that gets no reply (the coordinator handles it in order). Never
        waits for a call in flight: the frame is then queued and goes out right after it.
        A send that cannot finish within ``poll_s`` closes the connection."""
        frame = wire.encode([op, *args])
        if not self._lock.acquire(blocking=False):
            self._queued.append(frame)  # the lock holder sends it (see _unlock)
            return
        try:
            if self._queued:
                frame = self._take_queued() + frame
            if self._sock is None:
                return  # nothing to tell a coordinator we are no longer connected to
            # blocks up to SO_SNDTIMEO (poll_s) for room; a part sent then cannot be
            # completed later without desynchronising the stream
            if self._sock.send(frame) < len(frame):
                self._close_locked()
        except OSError:
            self._close_locked()
        finally:
            self._unlock()

    def _take_queued(self) -> bytes:
        out = []
        while self._queued:
            out.append(self._queued.popleft())
        return b"".join(out)

    def _flush_locked(self) -> None:
        if self._sock is None:
            self._queued.clear()  # nothing to tell a coordinator we are no longer connected to
            return
        if self._queued:
            try:
                _send_all(self._sock, self._take_queued(), time.monotonic() + self.poll_s)
            except OSError:
                self._close_locked()

    def _unlock(self) -> None:
        """Release the lock, then send what ``send`` queued meanwhile (unless another
        thread took the lock: it sends them with its own request)."""
        self._lock.release()
        while self._queued and self._lock.acquire(blocking=False):
            self._flush_locked()
            self._lock.release()

    def close_soon(self) -> None:
        """Shut the connection down without waiting for a call in flight (it fails at
        once); :meth:`close` then frees the socket."""
        self._closed = True
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _close_locked(self) -> None:
        self._closed = True
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        self.close_soon()
        with self._lock:
            self._close_locked()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _timeval(seconds: float) -> bytes:
    """``struct timeval`` of ``seconds``; never all zero (that means "wait forever")."""
    whole = int(seconds)
    return struct.pack("@ll", whole, max(int((seconds - whole) * 1e6), 0 if whole else 1))


def _send_all(sock: socket.socket, frame: bytes, deadline: float) -> None:
    view = memoryview(frame)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:  # SO_SNDTIMEO passed with the peer not reading
            if time.monotonic() >= deadline:
                raise TimeoutError("timed out sending") from None


def _recv_into(sock: socket.socket, buf: memoryview, deadline: float) -> int:
    while True:
        try:
            n = sock.recv_into(buf)
        except BlockingIOError:  # SO_RCVTIMEO passed with nothing to read
            if time.monotonic() >= deadline:
                raise TimeoutError("timed out waiting for the reply") from None
            continue
        if n == 0:
            raise EOFError("peer closed the connection")
        return n


def _recv_frame(sock: socket.socket, buf: bytearray, deadline: float) -> Any:
    """Read one whole frame (the only bytes the peer sends for one request) into ``buf``,
    or a larger buffer when it does not fit."""
    got = _recv_into(sock, memoryview(buf), deadline)
    while got < wire.HEADER.size:
        got += _recv_into(sock, memoryview(buf)[got:], deadline)
    (n,) = wire.HEADER.unpack_from(buf)
    if n > wire.MAX_FRAME:
        raise wire.ProtocolError(f"frame of {n} B exceeds the {wire.MAX_FRAME} B limit")
    total = wire.HEADER.size + n
    if got > total:
        raise wire.ProtocolError("the coordinator sent more than one reply")
    if total > len(buf):
        buf = buf[:got] + bytes(total - got)
    view = memoryview(buf)
    while got < total:
        got += _recv_into(sock, view[got:total], deadline)
    return wire.decode(view[wire.HEADER.size:total])
