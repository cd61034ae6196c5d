"""End-to-end checksums on Mooncake (``verify_checksums``): an 8-byte trailer per object.

Mooncake keeps no metadata of ours, so the checksum travels with the bytes: a writer
appends xxh3_64 of the object (:func:`kvcentric.store.base.checksum`, little-endian) as
an extra buffer of the same put, and a reader gets the object plus its trailer and
compares. A mismatch, or an object whose length is not ``size + 8`` (written by a
client without checksums), is ``ERR_CORRUPT``: the caller recomputes, nothing is
served. Trailers live in the store's registered staging arena (Mooncake transfers only
from and into registered memory). All clients of one cluster must agree on
``verify_checksums``; a client that disagrees reads every object as missing or corrupt,
never as data.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

from kvcentric.store.base import ERR_CORRUPT, ERR_NO_SPACE, ERR_UNAVAILABLE, StoreUnavailable
from kvcentric.store.mooncake.staging import StagingArena

if TYPE_CHECKING:
    from kvcentric.store.mooncake.ops import ClientOps

TRAILER = 8
_U64 = struct.Struct("<Q")


def digest(ptrs: Sequence[int], sizes: Sequence[int]) -> int:
    """xxh3_64 of the concatenated buffers (equal to ``checksum(ptr, size)`` for one)."""
    h = xxhash.xxh3_64()
    for p, n in zip(ptrs, sizes):
        h.update((ctypes.c_char * n).from_address(p))
    return h.intdigest()


def read_trailer(ptr: int) -> int:
    return int(_U64.unpack(ctypes.string_at(ptr, TRAILER))[0])


class Trailers:
    """Registered 8-byte slots for one batch; :meth:`free` when the call is done."""

    def __init__(self, staging: StagingArena, n: int) -> None:
        self._staging = staging
        self.ptrs = staging.alloc_run([TRAILER] * n)
        if len(self.ptrs) < n:
            self.free()
            raise MemoryError("mooncake staging is full: no room for checksum trailers")

    def seal(self, ptr_lists: Sequence[Sequence[int]],
             size_lists: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[list[int]]]:
        """Write each object's checksum into its trailer; return the buffer lists with the
        trailer appended (what the put sends)."""
        ptrs, sizes = [], []
        for t, p, n in zip(self.ptrs, ptr_lists, size_lists):
            ctypes.memmove(t, _U64.pack(digest(p, n)), TRAILER)
            ptrs.append([*p, t])
            sizes.append([*n, TRAILER])
        return ptrs, sizes

    def check(self, i: int, ptrs: Sequence[int], sizes: Sequence[int], got: int) -> int:
        """Object ``i``'s length if the bytes read into ``ptrs``/``sizes`` (``got``
        counts the trailer too) match its checksum, else ``ERR_CORRUPT``; a negative
        ``got`` passes through."""
        if got < 0:
            return got
        total = got - TRAILER
        if total < 0 or total > sum(sizes):
            return ERR_CORRUPT
        bufs, left = [], total
        for p, n in zip(ptrs, sizes):
            bufs.append((p, min(n, left)))
            left -= bufs[-1][1]
        if digest([p for p, _ in bufs], [n for _, n in bufs]) != read_trailer(self.ptrs[i]):
            return ERR_CORRUPT
        return total

    def free(self) -> None:
        self._staging.free(self.ptrs)


def put_sealed(ops: ClientOps, keys: list[str], ptrs: list[list[int]],
               sizes: list[list[int]], pin_s: float = 0.0,
               held: Sequence[int] | None = None) -> list[int]:
    """Put objects (given as buffer lists) each with its checksum trailer; ``held``: as
    :meth:`ClientOps.put_raw` (the trailers are held with the objects)."""
    try:
        trailers = Trailers(ops.staging, len(keys))
    except (MemoryError, StoreUnavailable):
        return [ERR_NO_SPACE] * len(keys)
    try:
        return ops.put_raw(keys, *trailers.seal(ptrs, sizes), pin_s,
                           None if held is None else [*held, *trailers.ptrs])
    finally:
        trailers.free()  # held trailers return once an abandoned put has returned


def get_checked(ops: ClientOps, keys: Sequence[str], ptr_lists: Sequence[Sequence[int]],
                size_lists: Sequence[Sequence[int]], held: Sequence[int] | None = None
                ) -> tuple[list[int], list[int | None]]:
    """Get each object over its buffers plus its trailer; per key the bytes read or a
    negative code (``ERR_CORRUPT`` on a mismatch, counted), and the verified checksums.
    ``held``: as :meth:`ClientOps.get` (the trailers are held with the objects)."""
    if not keys:
        return [], []
    try:
        trailers = Trailers(ops.staging, len(keys))
    except (MemoryError, StoreUnavailable):
        return [ERR_UNAVAILABLE] * len(keys), [None] * len(keys)
    try:
        k = list(keys)
        p = [[*ps, t] for ps, t in zip(ptr_lists, trailers.ptrs)]
        n = [[*ns, TRAILER] for ns in size_lists]
        got = ops.get(k, lambda c: c.batch_get_into_multi_buffers(k, p, n),
                         sum(map(sum, n)), None if held is None else [*held, *trailers.ptrs])
        out = [trailers.check(i, ptr_lists[i], size_lists[i], g) for i, g in enumerate(got)]
        sums = [read_trailer(t) if o >= 0 else None for o, t in zip(out, trailers.ptrs)]
    finally:
        trailers.free()
    ops.count(corrupt=out.count(ERR_CORRUPT))
    return out, sums
