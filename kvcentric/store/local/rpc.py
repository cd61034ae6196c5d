"""Client side of the coordinator protocol: msgpack frames over a Unix socket (see
:mod:`kvcentric.store.local.wire`).

Thread-safe. The coordinator answers a connection's requests in the order they were sent,
so several may be in flight: :meth:`RpcClient.submit` sends one and returns a
:class:`Pending` at once, :meth:`RpcClient.wait` reads replies (whoever's they are, handing
each to its request) until that one's has come, and :meth:`RpcClient.call` is the two. A
client that pipelines (sends the next chunk's request, then copies the current chunk's bytes
while the coordinator works) pays one round trip per batch instead of one per request.

Every wait has a deadline (its own ``timeout_s``, default the client's): waiting for the
connection's lock, sending and receiving all end by it (give or take one ``poll_s``). A
request that fails or runs past its deadline closes the connection for good (a late reply
would desynchronise the stream), fails every request still in flight on it, and raises
``StoreUnavailable``; the coordinator then reclaims that connection's leases and pending
writes. A closed client never reconnects: the owner makes a new one (so every connection is
one lease domain, see :mod:`kvcentric.store.local.session`).

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


class Pending:
    """A request sent on a connection whose reply has not been handed over yet."""

    __slots__ = ("op", "done", "value", "failure")

    def __init__(self, op: str) -> None:
        self.op = op
        self.done = False
        self.value: Any = None
        self.failure = ""  # why the connection closed before the reply came

    def settle(self, value: Any = None, failure: str = "") -> None:
        self.value, self.failure, self.done = value, failure, True


class RpcClient:
    """One connection to a coordinator, opened by :meth:`connect` and closed once."""

    def __init__(self, path: Path, timeout_s: float, poll_s: float | None = None) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.poll_s = min(timeout_s, poll_s or timeout_s)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = False
        self._buf = bytearray(READ_CHUNK)  # replies land here (one reader at a time)
        self._have = 0  # bytes of _buf received and not yet handed over
        self._queued: deque[bytes] = deque()  # one-way frames waiting for the lock
        self._pending: deque[Pending] = deque()  # sent, in order, replies not yet read

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
        return self.wait(self.submit(op, *args, timeout_s=limit), deadline=deadline)

    def submit(self, op: str, *args: Any, timeout_s: float | None = None) -> Pending:
        """Send one request now; its reply is :meth:`wait`'s. Sending is bounded by
        ``timeout_s`` (default the client's); ``StoreUnavailable`` when it fails."""
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
            except OSError as exc:
                self._close_locked(f"sending {op!r} failed: {exc or type(exc).__name__}")
                raise StoreUnavailable(f"store op {op!r} failed: {exc or type(exc).__name__}"
                                       ) from exc
            pending = Pending(op)
            self._pending.append(pending)
        finally:
            self._unlock()
        return pending

    def wait(self, pending: Pending, timeout_s: float | None = None,
             deadline: float | None = None) -> Any:
        """The reply to ``pending`` (a ``ValueError`` for a request the coordinator
        refused), reading the replies sent before it on the way; at most ``timeout_s``
        (default the client's) or until ``deadline``. ``StoreUnavailable`` when the
        connection fails or closes first, or on expiry (which closes it)."""
        if deadline is None:
            deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        op = pending.op
        if not pending.done:
            if not self._lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
                raise StoreUnavailable(f"store op {op!r}: connection busy")
            try:
                while not pending.done:
                    sock = self._sock
                    if sock is None or not self._pending:
                        break  # closed: _close_locked failed every request in flight
                    try:
                        reply = self._read_reply(sock, deadline)
                    except (OSError, EOFError, wire.ProtocolError) as exc:
                        why = f"{exc or type(exc).__name__}"
                        self._close_locked(f"waiting for {op!r} failed: {why}")
                        raise StoreUnavailable(f"store op {op!r} failed: {why}") from exc
                    self._pending.popleft().settle(reply)
                    if self._have and not self._pending:  # bytes nobody asked for
                        self._close_locked("the coordinator sent more replies than requests")
            finally:
                self._unlock()
        if not pending.done or pending.failure:
            raise StoreUnavailable(f"store op {op!r}: "
                                   f"{pending.failure or 'the connection is closed'}")
        reply = pending.value
        if isinstance(reply, list) and len(reply) == 2 and reply[0] == "error":
            raise ValueError(f"store rejected {op!r}: {reply[1]}")
        return reply

    def _read_reply(self, sock: socket.socket, deadline: float) -> Any:
        """The next whole reply frame (from bytes already received, else the socket)."""
        buf = self._buf
        while True:
            have = self._have
            if have >= wire.HEADER.size:
                (n,) = wire.HEADER.unpack_from(buf)
                if n > wire.MAX_FRAME:
                    raise wire.ProtocolError(f"frame of {n} B exceeds the {wire.MAX_FRAME} B "
                                             "limit")
                total = wire.HEADER.size + n
                if total > len(buf):  # a reply larger than the buffer: grow it for now
                    buf = self._buf = buf + bytes(total - len(buf))
                if have >= total:
                    reply = wire.decode(memoryview(buf)[wire.HEADER.size:total])
                    if have > total:  # the next replies' bytes, already here
                        buf[:have - total] = buf[total:have]
                    self._have = have - total
                    if len(buf) > READ_CHUNK and self._have <= READ_CHUNK:
                        self._buf = buf[:READ_CHUNK]
                    return reply
            self._have += _recv_into(sock, memoryview(buf)[have:], deadline)

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

    def _close_locked(self, why: str = "the connection was closed") -> None:
        self._closed = True
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        while self._pending:  # their replies can never come now
            self._pending.popleft().settle(failure=why)

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
