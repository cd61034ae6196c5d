"""The coordinator protocol's bytes: length-prefixed msgpack frames, nothing executable.

A frame is a 4-byte little-endian payload length, then the payload: a msgpack array
``[op, *args]`` for a request, any msgpack value for a reply (``["error", message]`` for a
rejected request). msgpack carries only data (ints, strings, lists, maps, None, bools), so
no frame can run code, unlike pickle. Frames above ``MAX_FRAME`` are refused: a hostile or
broken peer cannot make the coordinator allocate or wait for gigabytes.

**Nesting is bounded by the decoder's schema.** msgspec decodes recursively, and a frame of
nothing but nested array headers (200 KB of them) used to raise ``RecursionError`` deep in
the decoder. Each side decodes against a typed schema instead (:data:`Request`, 2 levels:
``[op, [keys...]]``; :data:`Reply`, 3 levels: ``[lease, [[offset, size, ...], ...]]``, or a
flat map): msgspec checks every value's type before it descends, so a deeper value fails
at the first level past the schema with a ``ProtocolError``, at the cost of an untyped
decode (no slower than the typed one). Nothing else about a frame can raise anything but
``ProtocolError`` here.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgspec

MAX_FRAME = 64 << 20  # a 100k-key request is ~10 MiB
HEADER = struct.Struct("<I")
# settle codes a client reports per leased object of a disk read (the coordinator's
# tiered index acts on them); here so the client need not import the coordinator's modules
PROMOTE, CORRUPT, MISSING = 1, 2, 3

Scalar = str | int | float | bool | None
Request = list[Scalar | list[Scalar]]  # [op, *args]; an arg is a scalar or a list of them
Reply = Scalar | list[Scalar | list[Scalar | list[Scalar]]] | dict[str, Scalar]

_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(Request)
_replies = msgspec.msgpack.Decoder(Reply)


class ProtocolError(ValueError):
    """A peer sent bytes that are not a valid frame (the connection must be closed)."""


def encode(value: Any) -> bytes:
    """One frame holding ``value`` (tuples travel as arrays)."""
    payload = _encoder.encode(value)
    if len(payload) > MAX_FRAME:
        raise ValueError(f"message of {len(payload)} B exceeds the {MAX_FRAME} B frame limit")
    return HEADER.pack(len(payload)) + payload


def decode_request(payload: bytes | memoryview) -> Any:
    """A request payload as data (the coordinator's side); ``ProtocolError`` if it is not
    msgpack of :data:`Request`'s shape (nesting bounded: module docstring)."""
    try:
        return _requests.decode(payload)
    except msgspec.MsgspecError as exc:
        raise ProtocolError(f"undecodable request: {exc}") from exc


def decode(payload: bytes | memoryview) -> Any:
    """A reply payload as data (a client's side); ``ProtocolError`` if it is not msgpack
    of :data:`Reply`'s shape."""
    try:
        return _replies.decode(payload)
    except msgspec.MsgspecError as exc:
        raise ProtocolError(f"undecodable reply: {exc}") from exc


# The arguments of every op, checked before the coordinator acts on them.
SIGNATURES: dict[str, Any] = {
    "exists": tuple[list[str]],
    "residency": tuple[list[str]],  # -> [run, [positions of disk-only objects]]
    "reserve": tuple[list[str], list[int], list[str | None]],
    "commit": tuple[list[str], list[int | None], float],  # keys, checksums, soft pin s
    "abort": tuple[list[str]],
    "acquire": tuple[list[str]],
    "release": tuple[int],
    "settle": tuple[int, list[int]],  # release + per-object disk-read report (tiered.py)
    "remove": tuple[str, bool],
    "keys": tuple[str, int],
    "clear": tuple[()],
    "stats": tuple[()],
    "hello": tuple[()],
    "shutdown": tuple[()],
    "auth": tuple[str],  # the admin token (kvcentric.store.local.gate)
}


def request_of(value: Any) -> tuple[str, list[Any]]:
    """Split a decoded request into (op, args); ``ProtocolError`` if it is not one."""
    if not isinstance(value, list) or not value or not isinstance(value[0], str):
        raise ProtocolError("a request is an array [op, *args] with a string op")
    return value[0], value[1:]


def checked_args(op: str, args: list[Any]) -> tuple[Any, ...]:
    """``args`` of ``op`` if they have the op's types; ``ValueError`` naming what is wrong."""
    sig = SIGNATURES.get(op)
    if sig is None:
        raise ValueError(f"unknown op {op[:64]!r}")
    try:
        out: tuple[Any, ...] = msgspec.convert(args, sig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad arguments for {op!r}: {exc}") from exc
    return out


class FrameBuffer:
    """Bytes received on a non-blocking socket, split into complete frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Append ``data``; return the complete payloads now available, in order."""
        self._buf += data
        out = []
        while len(self._buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self._buf)
            if n > MAX_FRAME:
                raise ProtocolError(f"frame of {n} B exceeds the {MAX_FRAME} B limit")
            if len(self._buf) < HEADER.size + n:
                break
            out.append(bytes(self._buf[HEADER.size:HEADER.size + n]))
            del self._buf[:HEADER.size + n]
        return out


def recv_frame(sock: socket.socket) -> Any:
    """Read one whole frame from a blocking socket (its timeout applies to each read)."""
    (n,) = HEADER.unpack(_recv_exactly(sock, HEADER.size))
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} B exceeds the {MAX_FRAME} B limit")
    return decode(_recv_exactly(sock, n))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("peer closed the connection")
        got += k
    return bytes(buf)
