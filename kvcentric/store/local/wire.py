"""The coordinator protocol's bytes: length-prefixed msgpack frames, nothing executable.

A frame is a 4-byte little-endian payload length, then the payload: a msgpack array
``[op, *args]`` for a request, any msgpack value for a reply (``["error", message]`` for a
rejected request). msgpack carries only data (ints, strings, lists, maps, None, bools), so
no frame can run code, unlike pickle. Frames above ``MAX_FRAME`` are refused: a hostile or
broken peer cannot make the coordinator allocate or wait for gigabytes.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgspec

MAX_FRAME = 64 << 20  # a 100k-key request is ~10 MiB
HEADER = struct.Struct("<I")

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class ProtocolError(ValueError):
    """A peer sent bytes that are not a valid frame (the connection must be closed)."""


def encode(value: Any) -> bytes:
    """One frame holding ``value`` (tuples travel as arrays)."""
    payload = _encoder.encode(value)
    if len(payload) > MAX_FRAME:
        raise ValueError(f"message of {len(payload)} B exceeds the {MAX_FRAME} B frame limit")
    return HEADER.pack(len(payload)) + payload


def decode(payload: bytes | memoryview) -> Any:
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from exc


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
