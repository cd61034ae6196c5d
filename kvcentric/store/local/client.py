"""``LocalStore``: the embedded shared-memory backend, client side.

Every process maps the coordinator's arena file (tmpfs) and copies bytes itself with one
``memmove`` per object; the coordinator only allocates, leases and commits. So a put or a
get costs one memcpy plus two small round trips per batch, and engines on one node share
physical pages.

Ownership: memory behind caller ``ptrs`` is the caller's. ``WriteSlot.ptr`` and
``ReadLease.ptrs`` point into the shared arena and are valid only until commit/abort and
release respectively; each keeps its arena mapping alive until then, and its session
(:mod:`kvcentric.store.local.session`) says whether the coordinator still honours it.

Every offset, size and file a coordinator sends is checked before a byte is copied or a
file opened (:mod:`kvcentric.store.local.replies`); a reply out of bounds kills its
session, like a failed call (the engine recomputes).
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvcentric.config import StoreConfig
from kvcentric.store.base import (
    ERR_CORRUPT,
    ERR_EXISTS,
    ERR_INVALID,
    ERR_NOT_FOUND,
    ERR_UNAVAILABLE,
    OK,
    KVStore,
    ReadLease,
    Residency,
    StoreUnavailable,
    WriteSlot,
    checksum,
)
from kvcentric.store.local import disk, replies
from kvcentric.store.local.disk_reads import READ_THREADS, DiskReads
from kvcentric.store.local.link import Link
from kvcentric.store.local.session import Session

if TYPE_CHECKING:
    from kvcentric.cuda.pinning import HostPinner

log = logging.getLogger("kvcentric.store")


class LocalStore(KVStore):
    """Client of a local store; starts the coordinator on first use when ``autostart``.

    Hot-path calls (lookups, ``reserve``, ``commit``, ``abort``, ``acquire``) wait at most
    ``cfg.hot_timeout_s`` and never connect: while the link's circuit breaker is open they
    fail at once (a miss, ``ERR_UNAVAILABLE`` or ``StoreUnavailable``: the engine
    recomputes) and a background thread reconnects (:mod:`kvcentric.store.local.link`).
    """

    def __init__(self, cfg: StoreConfig, required: bool = True) -> None:
        self.cfg = cfg
        self._link = Link(cfg)
        self._read_pool: ThreadPoolExecutor | None = None  # disk-tier reads, made on first use
        self._pin_warned = False  # told once that long pins are cut to max_pin_s
        try:
            self._link.connect()
        except StoreUnavailable as exc:
            if required:
                self._link.close()
                raise
            log.warning("store %r unavailable (%s); serving by recompute until it is back",
                        cfg.name, exc)
            self._link.kick()

    def arena_view(self, ptr: int, size: int) -> memoryview:
        """A writable memoryview of ``size`` arena bytes at ``ptr`` (from a slot or lease
        of the current generation)."""
        arena = self._link.arena
        off = ptr - arena.base if arena is not None else -1
        if arena is None or off < 0 or off + size > arena.capacity:
            raise ValueError("pointer is not inside the arena")
        return memoryview(arena.mm)[off : off + size]

    # ---- KVStore ----
    def batch_exists(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        s = self._link.session
        if s is None:
            self._link.kick()
            return 0
        n = _indexed_run(s, keys)
        if n is not None:
            return n
        try:
            return int(self._link.hot(s, "exists", list(keys)))
        except StoreUnavailable:
            return 0

    def residency_nowait(self, keys: Sequence[str]) -> Residency | None:
        """From the shared index when the store has no disk tier (whose tiers the index
        does not record) and its coordinator is alive; else None."""
        if not keys:
            return Residency(0)
        s = self._link.session
        if s is None or s.disk_tier:
            return None
        n = _indexed_run(s, keys)
        return None if n is None else Residency(n)

    def batch_residency(self, keys: Sequence[str]) -> Residency:
        """With a disk tier: the coordinator's exact answer, one round trip (the shared
        index does not record tiers). Without one nothing is on disk: ``batch_exists``
        (the shared index, no round trip). An unreachable store holds nothing (run 0)."""
        if not keys:
            return Residency(0)
        s = self._link.session
        if s is None or not s.disk_tier:
            return Residency(self.batch_exists(keys))
        try:
            run, disk_only = self._link.hot(s, "residency", list(keys))
        except StoreUnavailable:
            return Residency(0)
        return Residency(int(run), tuple(int(i) for i in disk_only))

    def batch_alloc(self, keys: Sequence[str], sizes: Sequence[int],
                    parents: Sequence[str | None] | None = None) -> list[WriteSlot | None]:
        return self._reserve(keys, sizes, parents)[0]

    def _reserve(self, keys: Sequence[str], sizes: Sequence[int],
                 parents: Sequence[str | None] | None) -> tuple[list[WriteSlot | None], list[int]]:
        """Slots for new keys (None where the key exists or space ran out) and reserve
        codes. Each slot holds a reference on its arena until committed or aborted."""
        if len(keys) != len(sizes) or (parents is not None and len(parents) != len(keys)):
            raise ValueError("keys, sizes and parents must have equal lengths")
        if not keys:
            return [], []
        s = self._link.live()
        arena = s.arena
        if not arena.hold():  # taken before the call: the mapping cannot go meanwhile
            raise StoreUnavailable(f"store {self.cfg.name!r}: arena released")
        ints = [int(n) for n in sizes]
        try:
            codes = self._link.hot(s, "reserve", list(keys), ints,
                                   list(parents) if parents is not None else [None] * len(keys))
            replies.check_slots(codes, ints, arena.capacity)
        except replies.BadReply as exc:
            arena.drop()
            self._link.trip(s, exc)  # its slots die with it: the coordinator reclaims them
            raise
        except BaseException:
            arena.drop()
            raise
        slots = [WriteSlot(k, arena.base + off, int(n), s) if off >= 0 else None
                 for k, n, off in zip(keys, sizes, codes)]
        live = sum(1 for x in slots if x is not None)
        if live == 0:
            arena.drop()
        elif live > 1:
            arena.hold(live - 1)  # one reference per slot; we hold one, so this succeeds
        return slots, codes

    @staticmethod
    def _end_slots(slots: Sequence[WriteSlot]) -> None:
        """Slots are done (committed, aborted or stale): drop their arena references."""
        arena, n = None, 0  # one drop per run of slots of one arena (usually all)
        for slot in slots:
            s, slot.handle = slot.handle, None
            if isinstance(s, Session):
                if s.arena is not arena:
                    if arena is not None:
                        arena.drop(n)
                    arena, n = s.arena, 0
                n += 1
        if arena is not None:
            arena.drop(n)

    def batch_commit(self, slots: Sequence[WriteSlot], pin_s: float = 0.0) -> list[int]:
        """Publish written slots. Slots of a dead session (the connection dropped since
        their reserve: the coordinator reclaimed them) are ``ERR_UNAVAILABLE``."""
        if not slots:
            return []
        s = self._link.session
        if s is None or any(x.handle is not s for x in slots):
            self._end_slots(slots)
            return [ERR_UNAVAILABLE] * len(slots)
        sums = [checksum(x.ptr, x.size) if self.cfg.verify_checksums else None for x in slots]
        try:
            if pin_s > s.max_pin_s and not s.admin:
                pin_s = self._long_pin(s, pin_s)
            codes = list(self._link.hot(s, "commit", [x.key for x in slots], sums,
                                        float(pin_s)))
        except StoreUnavailable:
            codes = [ERR_UNAVAILABLE] * len(slots)
        except ValueError:  # refused (a pin out of bounds): nothing was committed
            self.batch_abort(slots)
            raise
        if len(codes) != len(slots):
            self._link.trip(s, replies.BadReply("commit: the reply does not match the request"))
            codes = [ERR_UNAVAILABLE] * len(slots)
        self._end_slots(slots)
        return codes

    def _long_pin(self, s: Session, pin_s: float) -> float:
        """A pin over the coordinator's ``max_pin_s`` is an admin operation (gate.py):
        present the token, or, when it cannot be read (a ``peer_group`` member), pin for
        ``max_pin_s`` only."""
        try:
            self._link.authenticate(s)
            return pin_s
        except StoreUnavailable as exc:
            if not s.alive:
                raise
            if not self._pin_warned:
                self._pin_warned = True
                log.warning("store %r: pinning for %.0f s, not %.0f s: %s", self.cfg.name,
                            s.max_pin_s, pin_s, exc)
            return s.max_pin_s

    def batch_abort(self, slots: Sequence[WriteSlot]) -> None:
        s = self._link.session
        live = [x.key for x in slots if s is not None and x.handle is s]
        try:
            if live and s is not None:
                self._link.hot(s, "abort", live)
        except StoreUnavailable:
            pass  # the coordinator reclaims them with the connection
        finally:
            self._end_slots(slots)

    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
                       parents: Sequence[str | None] | None = None) -> list[int]:
        if len(keys) != len(ptrs) or len(keys) != len(sizes):
            raise ValueError("keys, ptrs and sizes must have equal lengths")
        try:
            slots, codes = self._reserve(keys, sizes, parents)
        except StoreUnavailable:
            return [ERR_UNAVAILABLE] * len(keys)
        live = [s for s in slots if s is not None]
        for s, src in zip(slots, ptrs):
            if s is not None:
                ctypes.memmove(s.ptr, src, s.size)
        committed = iter(self.batch_commit(live))
        # a key already stored (or being stored by another writer) counts as stored
        return [next(committed) if s is not None else (OK if c == ERR_EXISTS else c)
                for s, c in zip(slots, codes)]

    def batch_acquire(self, keys: Sequence[str], sizes: Sequence[int] | None = None) -> ReadLease:
        return self._acquire(keys, eager=True)

    def batch_acquire_streamed(self, keys: Sequence[str], sizes: Sequence[int]) -> ReadLease:
        """DRAM objects are in place at once; disk-tier objects arrive range by range
        through :meth:`fetch_range` (docs/store.md §Disk tier)."""
        return self._acquire(keys, eager=False)

    def _acquire(self, keys: Sequence[str], eager: bool) -> ReadLease:
        """Lease the leading run; the lease holds a reference on its arena (and its
        session decides its validity) until released."""
        if not keys:
            return ReadLease([], [], [], [], None)
        s = self._link.live()
        arena = s.arena
        if not arena.hold():
            raise StoreUnavailable(f"store {self.cfg.name!r}: arena released")
        reads = None
        try:
            asked = time.monotonic()
            asking = list(keys)
            try:
                lease_id, entries = replies.check_lease(
                    self._link.hot(s, "acquire", asking), asking, arena.capacity, s.tier)
            except replies.BadReply as exc:
                self._link.trip(s, exc)  # nothing read: the lease dies with the session
                raise
            # the coordinator reclaims the lease lease_ttl_s after it granted it, which is
            # after we asked: treating it as lapsed from asked + ttl is always on the safe side
            deadline = asked + s.lease_ttl_s if s.lease_ttl_s > 0 else float("inf")
            if any(len(e) > 3 for e in entries):
                tier, owner = s.tier, s.owner
                assert tier is not None  # check_lease refused disk entries without one
                reads = DiskReads(len(entries), self._disk_pool(),
                                  self.cfg.local.disk_read_timeout_s,
                                  lambda path: disk.open_object(tier, path, owner))
            ptrs: list[int] = []
            for i, ent in enumerate(entries):
                if len(ent) == 3:
                    ptrs.append(arena.base + ent[0])
                    continue
                assert reads is not None
                promo = arena.base + ent[0] if ent[0] >= 0 else None
                ptr = reads.open(i, ent[3], ent[1], ent[4], promo)
                if ptr is None:
                    break  # its file is gone: the leading run ends here
                ptrs.append(ptr)
            n = len(ptrs)
            if reads is not None and eager:
                bad = reads.fetch_all()
                n = bad if 0 <= bad < n else n
        except BaseException:
            if reads is None:
                arena.drop()
            else:  # once no read can still write into the arena
                reads.close(lambda _: arena.drop())
            raise
        return ReadLease(list(keys[:n]), ptrs[:n], [e[1] for e in entries[:n]],
                         [e[2] for e in entries[:n]], (lease_id, s, deadline, reads, n))

    def _disk_pool(self) -> ThreadPoolExecutor:
        if self._read_pool is None:
            self._read_pool = ThreadPoolExecutor(READ_THREADS, "kvc-disk-read")
        return self._read_pool

    def fetch_range(self, lease: ReadLease, offset: int, size: int) -> None:
        reads = lease.handle[3] if lease.handle is not None else None
        if reads is None:
            return  # DRAM objects are in place already
        try:
            reads.fetch(offset, size, lease.handle[4])
        except OSError as exc:  # TimeoutError included: the disk is too slow
            raise StoreUnavailable(f"disk-tier read failed: {exc or type(exc).__name__}"
                                   ) from exc

    def release(self, lease: ReadLease) -> None:
        """End ``lease``: tell its coordinator (if its session lives) and drop its arena
        reference, once no disk read writes into its memory (bounded wait: a read still
        running then ends the lease itself)."""
        if lease.handle is None:
            return
        lease_id, s, _, reads, _ = lease.handle
        lease.handle = None
        if reads is None:
            if lease_id and s.alive:
                s.rpc.send("release", lease_id)
            s.arena.drop()
            return

        def settle(codes: list[int]) -> None:
            if lease_id and s.alive:
                s.rpc.send("settle", lease_id, codes)
            s.arena.drop()

        if not reads.close(settle):
            log.warning("store %r: a disk-tier read outlived its lease's release; the lease "
                        "ends when it does", self.cfg.name)

    def lease_valid(self, lease: ReadLease) -> bool:
        """False when ``lease``'s session died since it was taken (a failed or timed-out
        call, or the coordinator closed the connection or died: either way its leases
        were reclaimed or its generation is gone), or its TTL ran out, or an object read
        from the disk tier is incomplete or fails its checksum."""
        if lease.handle is None:
            return False
        _, s, deadline, reads, n = lease.handle
        if reads is not None and not reads.verified(n):
            return False
        return time.monotonic() < deadline and s.peer_alive()

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        if len(keys) != len(ptrs) or len(keys) != len(sizes):
            raise ValueError("keys, ptrs and sizes must have equal lengths")
        try:
            lease = self.batch_acquire(keys)
        except StoreUnavailable:
            return [ERR_UNAVAILABLE] * len(keys)
        out = [ERR_NOT_FOUND] * len(keys)
        try:
            for i, (src, size) in enumerate(zip(lease.ptrs, lease.sizes)):
                if size > sizes[i]:
                    out[i] = ERR_INVALID
                    continue
                ctypes.memmove(ptrs[i], src, size)
                out[i] = size
            self._verify(lease, ptrs, out)
            if not self.lease_valid(lease):
                return [ERR_UNAVAILABLE] * len(keys)  # copied without a lease: can't trust it
        finally:
            self.release(lease)
        return out

    def _verify(self, lease: ReadLease, ptrs: Sequence[int], out: list[int]) -> None:
        if not self.cfg.verify_checksums:
            return
        for i, want in enumerate(lease.checksums):
            if out[i] > 0 and want is not None and not lease.verified(i, ptrs[i]):
                log.warning("checksum mismatch for %s: treating as missing", lease.keys[i])
                out[i] = ERR_CORRUPT

    def remove(self, key: str, force: bool = False) -> int:
        return int(self._link.call("remove", key, force))

    def list_keys(self, prefix: str = "", limit: int = 1000) -> list[str]:
        """Committed keys that start with ``prefix`` (for inspection and tests)."""
        return list(self._link.call("keys", prefix, limit))

    def clear(self) -> int:
        """Remove every unleased object; returns how many. An admin operation: the
        coordinator's token must be readable (``StoreUnavailable`` otherwise)."""
        return int(self._link.admin_call("clear"))

    def stats(self) -> dict[str, Any]:
        return dict(self._link.call("stats"))

    def pin_host_memory(self, pinner: HostPinner) -> None:
        self._link.pin(pinner)

    def close(self) -> None:
        """Close the link. Mappings still used by unreleased leases or slots stay until
        those are released; disk reads in flight are not waited for (each holds its
        lease's memory until it ends)."""
        if self._read_pool is not None:
            self._read_pool.shutdown(wait=False, cancel_futures=True)
            self._read_pool = None
        self._link.close()


def _indexed_run(s: Session, keys: Sequence[str]) -> int | None:
    """The leading run of ``keys`` from ``s``'s shared index (no round trip), or None:
    no index, a dead or stale coordinator, a write in progress, or the session closed
    under us (its index unmapped)."""
    if s.index is None or not s.peer_alive():
        return None
    try:
        return s.index.leading_run(keys)
    except ValueError:
        return None
