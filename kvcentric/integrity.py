"""End-to-end integrity of stored objects: every object names what it was written for.

A stored object is ``[header region][payload]``. The header region is
:data:`HEADER_BYTES` long (the payload stays 256-byte aligned for DMA); its first
:data:`HEADER.size` bytes say, little-endian::

    magic "KVCH" | version u16 | header region bytes u16 | tp_rank u16 | tp_size u16 |
    kind u8 (0 block, 1 tail, 2 state) | 3 pad | block index u32 | token count u32 |
    payload bytes u64 | key-space digest 8 B | chain digest 16 B | 8 reserved (zero)

The writer fills it from the :class:`ObjectRef` it saves (the block's chain hash, its
index in the prompt, its token count) and its :class:`~kvcentric.hashing.KeySpace` (model,
layout signature with the model revision, TP rank). A reader compares the whole header
with the one it expects for the key it asked for *before it unpacks a byte*: whatever
happens to the store (a restarted coordinator reusing memory, a bug, a rank's shard
under another rank's key, an old format), an object is never loaded into a prompt,
rank or layout it was not written for. A mismatch is a load error: the engine
recomputes, counted as ``integrity_errors``. The header costs one 64-byte compare per
object; payload checksums (``verify_checksums``) stay optional.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import xxhash

from kvcentric.hashing import KeySpace, TailRef

HEADER = struct.Struct("<4sHHHHB3xIIQ8s16s8x")
HEADER_BYTES = 256  # header region; the payload starts here
MAGIC = b"KVCH"
VERSION = 1
assert HEADER.size <= HEADER_BYTES


@dataclass(frozen=True)
class ObjectRef:
    """One stored object of a prompt, as its writer and its readers know it.

    ``digest``: the chain hash of a full block (:func:`kvcentric.hashing.block_hashes`) or
    a tail's :func:`~kvcentric.hashing.tail_hash`; ``index``: the stored block's position
    in the prompt (a tail: the index of the partial block); ``count``: tokens it holds
    (``block_size``, or the tail's count); ``tail``: a partial last block; ``state``: the
    recurrent state (hybrid models) after block ``index``, whose chain hash ``digest`` is.
    """

    digest: bytes
    index: int
    count: int
    tail: bool = False
    state: bool = False

    @property
    def kind(self) -> int:
        """The header's kind byte: 0 block, 1 tail, 2 state."""
        return 2 if self.state else int(self.tail)

    def key(self, keyspace: KeySpace) -> str:
        """Its store key in ``keyspace`` (each TP rank has its own)."""
        if self.tail:
            return keyspace.tail_key(TailRef(self.digest, self.count))
        if self.state:
            return keyspace.state_key(self.digest)
        return keyspace.key(self.digest)


class ObjectHeaders:
    """Writes and checks the headers of one key space's objects of ``payload_bytes``."""

    def __init__(self, keyspace: KeySpace, payload_bytes: int) -> None:
        if payload_bytes <= 0:
            raise ValueError(f"payload_bytes must be positive, got {payload_bytes}")
        self.keyspace = keyspace
        self.payload_bytes = payload_bytes
        self._space = xxhash.xxh3_64_digest(keyspace.prefix.encode())

    @property
    def object_bytes(self) -> int:
        """Header region plus payload: the size of every object in the store."""
        return HEADER_BYTES + self.payload_bytes

    def expected(self, ref: ObjectRef) -> bytes:
        """The exact header bytes an object written for ``ref`` starts with."""
        ks = self.keyspace
        return HEADER.pack(MAGIC, VERSION, HEADER_BYTES, ks.tp_rank, ks.tp_size,
                           ref.kind, ref.index, ref.count, self.payload_bytes,
                           self._space, ref.digest)

    def write(self, ptr: int, ref: ObjectRef) -> None:
        """Write ``ref``'s header at ``ptr`` (an object's first byte; zeroes the rest of
        the header region)."""
        head = self.expected(ref)
        ctypes.memmove(ptr, head + bytes(HEADER_BYTES - len(head)), HEADER_BYTES)

    def check(self, ptr: int, ref: ObjectRef) -> bool:
        """True when the object at ``ptr`` was written for ``ref`` in this key space."""
        return ctypes.string_at(ptr, HEADER.size) == self.expected(ref)

    def describe(self, ptr: int) -> str:
        """What the header at ``ptr`` claims, for a log line after a failed check."""
        return describe(ctypes.string_at(ptr, HEADER.size))


def describe(raw: bytes) -> str:
    """Human-readable header bytes (``ObjectHeaders.expected`` or read from an object)."""
    magic, ver, _, rank, size, kind, index, count, payload, _, digest = HEADER.unpack(raw)
    if magic != MAGIC:
        return f"no kvcentric header (starts {raw[:8].hex()})"
    return (f"v{ver} rank {rank}of{size} {('block', 'tail', 'state')[min(kind, 2)]} {index} "
            f"({count} tokens, {payload} B) chain {digest.hex()[:16]}")
