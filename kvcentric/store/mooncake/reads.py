"""In-place reads of a :class:`~kvcentric.store.mooncake.store.MooncakeStore`, through its
:class:`~kvcentric.store.mooncake.ops.ClientOps`.

A lease reserves extents of the store's registered staging arena and either gets every
object whole into them (``batch_get_into``), or only opens a get session (the master
resolves the replicas once) so that :meth:`LeaseReads.fetch_range` can later get one byte
range of every object per call: the vLLM worker fetches layer ``l`` just before layer
``l`` runs (docs/store.md §Mooncake). The staging extents and the session belong to the
lease until :meth:`LeaseReads.release`. Every call is bounded (:meth:`ClientOps.call`): a
get that overruns is abandoned with its extents held, so a lease released meanwhile
gives them back only once that get has returned.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcentric.store.base import ERR_UNAVAILABLE, OK, ReadLease, StoreUnavailable
from kvcentric.store.mooncake.checksums import get_checked
from kvcentric.store.mooncake.client import chunks

if TYPE_CHECKING:
    from kvcentric.store.mooncake.ops import ClientOps

log = logging.getLogger("kvcentric.store")


@dataclass
class _Held:
    """A lease's staging extents (and, for a streamed lease, its open get session)."""

    owner: LeaseReads
    ptrs: list[int]
    session: bool = False


class LeaseReads:
    """The read leases of one store (its staging arena, client and counters, all through
    ``ops``)."""

    def __init__(self, ops: ClientOps) -> None:
        self.ops = ops

    def lease(self, keys: Sequence[str], sizes: Sequence[int], session: bool) -> ReadLease:
        """Reserve staging for ``keys`` (a leading prefix when it fills up), then get them
        whole, or (``session``) only open a get session; lease the leading run present."""
        if not keys:
            return ReadLease([], [], [], [], None)
        ptrs = self.ops.staging.alloc_run(list(sizes))
        keys, sizes = list(keys[:len(ptrs)]), list(sizes[:len(ptrs)])
        sums: list[int | None] = [None] * len(keys)
        if session and not self.ops.cfg.verify_checksums:  # a checksum needs the whole
            codes = self.ops.get(keys, lambda c: c.batch_get_session_start(keys), 0, ())
            n = next((i for i, c in enumerate(codes) if c != OK), len(codes))
            self.end_session(keys[n:])
        else:
            session = False
            if self.ops.cfg.verify_checksums:
                codes, sums = get_checked(self.ops, keys, [[p] for p in ptrs],
                                          [[s] for s in sizes], ptrs)
            else:
                codes = self.ops.get(keys, lambda c: c.batch_get_into(keys, ptrs, sizes),
                                        sum(sizes), ptrs)
            n = next((i for i, c in enumerate(codes) if c <= 0), len(codes))
        self.ops.staging.free(ptrs[n:])
        if n == 0 and ERR_UNAVAILABLE in codes:
            raise StoreUnavailable("mooncake master unreachable")
        got = sizes[:n] if session else codes[:n]  # a session has moved no bytes yet
        return ReadLease(keys[:n], ptrs[:n], got, sums[:n], _Held(self, ptrs[:n], session))

    def fetch_range(self, lease: ReadLease, offset: int, size: int) -> None:
        """Get ``[offset, offset + size)`` of every object of a streamed lease."""
        held = lease.handle
        if not isinstance(held, _Held) or held.owner is not self or not held.session:
            return
        for c in chunks([[p] for p in held.ptrs]):
            keys, ptrs = lease.keys[c], held.ptrs[c]
            got = self.ops.call(
                lambda m, keys=keys, ptrs=ptrs: m.batch_get_into_multi_buffer_ranges(
                    keys, [[p + offset] for p in ptrs], [[size]] * len(ptrs),
                    [[offset]] * len(ptrs)), "ranged get", size * len(ptrs), ptrs)
            bad = [int(g) for g in got if int(g) != size]
            if bad:
                self.ops.mapped([g for g in bad if g < 0])
                raise StoreUnavailable(f"ranged get of {len(bad)} objects failed: {bad[:3]}")
            self.ops.count(get_bytes=size * len(got))

    def release(self, lease: ReadLease) -> None:
        held, lease.handle = lease.handle, None
        if not isinstance(held, _Held) or held.owner is not self:
            return
        self.ops.free(held.ptrs)
        if held.session:
            self.end_session(lease.keys)

    def end_session(self, keys: list[str]) -> None:
        """Drop a get session's cached replicas (best effort, bounded; skipped while the
        breaker is open: a release must not wait for a hung master, and the few sessions
        in flight at an outage cost the client a few cached descriptors)."""
        if not keys:
            return
        try:
            self.ops.call(lambda c: c.batch_get_session_end(keys), "get session end")
        except Exception as exc:  # never let cleanup fail a request
            log.debug("batch_get_session_end failed: %s", exc)
