"""``LocalStore``: the embedded shared-memory backend, client side.

Every process maps the coordinator's arena file (tmpfs) and copies bytes itself with one
``memmove`` per object; the coordinator only allocates, leases and commits. So a put or a
get costs one memcpy plus small round trips, and engines on one node share physical pages.
``batch_put_from`` and ``batch_get_into`` pipeline them: a batch goes in chunks of about
``PIPELINE_BYTES``, and each chunk's request (reserve, acquire) is sent before the previous
chunk's bytes are copied and its commit sent without waiting, so the coordinator works on
one core while this process copies on another; a batch exposes about one round trip of one
chunk, not two round trips of the whole batch.

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
from dataclasses import dataclass
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
from kvcentric.store.local.rpc import Pending
from kvcentric.store.local.session import Arena, Session

if TYPE_CHECKING:
    from kvcentric.cuda.pinning import HostPinner

log = logging.getLogger("kvcentric.store")

PIPELINE_BYTES = 4 << 20
"""Bytes per chunk of a pipelined batch: enough copying to hide the next chunk's round
trip, few enough chunks that their round trips stay cheap."""


def chunks(sizes: Sequence[int], chunk_bytes: int | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` index ranges of consecutive objects of about ``chunk_bytes`` each
    (default :data:`PIPELINE_BYTES`; a chunk ends at the object that reaches it, the last
    takes what is left)."""
    if chunk_bytes is None:
        chunk_bytes = PIPELINE_BYTES
    out, start, acc = [], 0, 0
    for i, n in enumerate(sizes):
        acc += n
        if acc >= chunk_bytes:
            out.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


@dataclass
class _Sent:
    """A hot request sent and not yet taken, with what its reply is checked against; it
    holds a reference on ``arena`` until taken."""

    pending: Pending
    arena: Arena
    keys: Sequence[str]
    sizes: list[int]
    asked: float = 0.0


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
        if s.index is not None and s.peer_alive():
            try:
                n = s.index.leading_run(keys)  # None: stale heartbeat, writer busy...
            except ValueError:  # the session closed under us: its index is unmapped
                n = None
            if n is not None:
                return n
        try:
            return int(self._link.hot(s, "exists", list(keys)))
        except StoreUnavailable:
            return 0

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
        if len(keys) != len(sizes) or (parents is not None and len(parents) != len(keys)):
            raise ValueError("keys, sizes and parents must have equal lengths")
        if not keys:
            return []
        s = self._link.live()
        return self._reserve_take(s, self._reserve_send(s, keys, sizes, parents))[0]

    def _reserve_send(self, s: Session, keys: Sequence[str], sizes: Sequence[int],
                      parents: Sequence[str | None] | None) -> _Sent:
        """Ask ``s``'s coordinator for slots for ``keys`` (taken by :meth:`_reserve_take`);
        the arena reference taken here keeps its mapping until then."""
        arena = s.arena
        if not arena.hold():  # taken before the call: the mapping cannot go meanwhile
            raise StoreUnavailable(f"store {self.cfg.name!r}: arena released")
        ints = [int(n) for n in sizes]
        try:
            pending = self._link.hot_send(
                s, "reserve", list(keys), ints,
                list(parents) if parents is not None else [None] * len(keys))
        except BaseException:
            arena.drop()
            raise
        return _Sent(pending, arena, keys, ints)

    def _reserve_take(self, s: Session, sent: _Sent) -> tuple[list[WriteSlot | None], list[int]]:
        """Slots for new keys (None where the key exists or space ran out) and reserve
        codes. Each slot holds a reference on its arena until committed or aborted."""
        arena = sent.arena
        try:
            codes = self._link.hot_wait(s, sent.pending)
            replies.check_slots(codes, sent.sizes, arena.capacity)
        except replies.BadReply as exc:
            arena.drop()
            self._link.trip(s, exc)  # its slots die with it: the coordinator reclaims them
            raise
        except BaseException:
            arena.drop()
            raise
        slots = [WriteSlot(k, arena.base + off, n, s) if off >= 0 else None
                 for k, n, off in zip(sent.keys, sent.sizes, codes)]
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
        try:
            if pin_s > s.max_pin_s and not s.admin:
                pin_s = self._long_pin(s, pin_s)
        except StoreUnavailable:
            self._end_slots(slots)
            return [ERR_UNAVAILABLE] * len(slots)
        return self._commit_take(s, slots, self._commit_send(s, slots, pin_s))

    def _commit_send(self, s: Session, slots: Sequence[WriteSlot],
                     pin_s: float) -> Pending | None:
        """Send the commit of ``slots`` (of session ``s``, written); ``None`` when it
        could not be sent (``s`` is dead)."""
        sums = [checksum(x.ptr, x.size) if self.cfg.verify_checksums else None for x in slots]
        try:
            return self._link.hot_send(s, "commit", [x.key for x in slots], sums,
                                       float(pin_s))
        except StoreUnavailable:
            return None

    def _commit_take(self, s: Session, slots: Sequence[WriteSlot],
                     pending: Pending | None) -> list[int]:
        """The codes of a commit sent by :meth:`_commit_send`; ends ``slots``."""
        codes = [ERR_UNAVAILABLE] * len(slots)
        try:
            if pending is not None:
                got = list(self._link.hot_wait(s, pending))
                if len(got) == len(slots):
                    codes = got
                else:
                    self._link.trip(s, replies.BadReply("commit: the reply does not match "
                                                        "the request"))
        except StoreUnavailable:
            pass
        except ValueError:  # refused (a pin out of bounds): nothing was committed
            self.batch_abort(slots)
            raise
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
        """Pipelined (module docstring): chunk ``k + 1``'s reserve goes out before chunk
        ``k`` is copied, and chunk ``k``'s commit right after; the commits' codes are
        taken at the end. A chunk that cannot be reserved ends the batch (it and the
        rest are ``ERR_UNAVAILABLE``). With a disk tier the batch is one chunk: the
        coordinator may hold a reserve back for the demoter, and a commit sent behind it
        would wait with it."""
        if len(keys) != len(ptrs) or len(keys) != len(sizes) or (
                parents is not None and len(parents) != len(keys)):
            raise ValueError("keys, ptrs, sizes and parents must have equal lengths")
        out = [ERR_UNAVAILABLE] * len(keys)
        if not keys:
            return out

        def reserve(a: int, b: int) -> _Sent:
            return self._reserve_send(s, keys[a:b], sizes[a:b],
                                      parents[a:b] if parents is not None else None)

        try:
            s = self._link.live()
            parts = chunks(sizes) if not s.disk_tier else [(0, len(keys))]
            nxt: _Sent | None = reserve(*parts[0])
        except StoreUnavailable:
            return out
        sent = []  # (first index, slots, reserve codes, live slots, the commit in flight)
        for k, (a, b) in enumerate(parts):
            assert nxt is not None
            try:
                slots, codes = self._reserve_take(s, nxt)
            except StoreUnavailable:
                break
            nxt = None
            if k + 1 < len(parts):
                try:
                    nxt = reserve(*parts[k + 1])
                except StoreUnavailable:
                    pass  # this chunk's commit finds the session dead too
            for slot, src in zip(slots, ptrs[a:b]):
                if slot is not None:
                    ctypes.memmove(slot.ptr, src, slot.size)
            live = [x for x in slots if x is not None]
            sent.append((a, slots, codes, live,
                         self._commit_send(s, live, 0.0) if live else None))
            if nxt is None:
                break
        for a, slots, codes, live, pending in sent:
            committed = iter(self._commit_take(s, live, pending) if live else [])
            # a key already stored (or being stored by another writer) counts as stored
            for i, (slot, c) in enumerate(zip(slots, codes)):
                out[a + i] = next(committed) if slot is not None else (
                    OK if c == ERR_EXISTS else c)
        return out

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
        return self._acquire_take(s, self._acquire_send(s, keys), eager)

    def _acquire_send(self, s: Session, keys: Sequence[str]) -> _Sent:
        """Ask ``s``'s coordinator to lease ``keys`` (taken by :meth:`_acquire_take`)."""
        arena = s.arena
        if not arena.hold():
            raise StoreUnavailable(f"store {self.cfg.name!r}: arena released")
        asked = time.monotonic()
        try:
            pending = self._link.hot_send(s, "acquire", list(keys))
        except BaseException:
            arena.drop()
            raise
        return _Sent(pending, arena, keys, [], asked)

    def _acquire_take(self, s: Session, sent: _Sent, eager: bool) -> ReadLease:
        """The lease of an acquire sent by :meth:`_acquire_send` (see :meth:`_acquire`)."""
        arena, keys = sent.arena, sent.keys
        reads = None
        try:
            asking = list(keys)
            try:
                lease_id, entries = replies.check_lease(
                    self._link.hot_wait(s, sent.pending), asking, arena.capacity, s.tier)
            except replies.BadReply as exc:
                self._link.trip(s, exc)  # nothing read: the lease dies with the session
                raise
            # the coordinator reclaims the lease lease_ttl_s after it granted it, which is
            # after we asked: treating it as lapsed from asked + ttl is always on the safe side
            deadline = sent.asked + s.lease_ttl_s if s.lease_ttl_s > 0 else float("inf")
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
        """Pipelined (module docstring): chunk ``k + 1``'s acquire goes out before chunk
        ``k`` is copied, while chunk ``k`` was leased whole (the leading run goes on). Every
        lease is checked after all copies and released at the end."""
        if len(keys) != len(ptrs) or len(keys) != len(sizes):
            raise ValueError("keys, ptrs and sizes must have equal lengths")
        parts = chunks(sizes)
        if not parts:
            return []
        try:
            s = self._link.live()
            nxt: _Sent | None = self._acquire_send(s, keys[parts[0][0]:parts[0][1]])
        except StoreUnavailable:
            return [ERR_UNAVAILABLE] * len(keys)
        out = [ERR_NOT_FOUND] * len(keys)
        leases: list[ReadLease] = []
        try:
            for k, (a, b) in enumerate(parts):
                assert nxt is not None
                sent, nxt = nxt, None
                try:
                    lease = self._acquire_take(s, sent, eager=True)
                except StoreUnavailable:
                    return [ERR_UNAVAILABLE] * len(keys)
                leases.append(lease)
                if len(lease.ptrs) == b - a and k + 1 < len(parts):
                    try:
                        nxt = self._acquire_send(s, keys[b:parts[k + 1][1]])
                    except StoreUnavailable:
                        pass  # the leases taken so far are no longer valid either
                for i, (src, size) in enumerate(zip(lease.ptrs, lease.sizes)):
                    if size > sizes[a + i]:
                        out[a + i] = ERR_INVALID
                        continue
                    ctypes.memmove(ptrs[a + i], src, size)
                    out[a + i] = size
                self._verify(lease, ptrs, out, a)
                if nxt is None:
                    break
            if not all(self.lease_valid(lease) for lease in leases):
                return [ERR_UNAVAILABLE] * len(keys)  # copied without a lease: can't trust it
        finally:
            if nxt is not None:  # sent, never taken (an exception above): end its lease
                try:
                    leases.append(self._acquire_take(s, nxt, eager=False))
                except StoreUnavailable:
                    pass
            for lease in leases:
                self.release(lease)
        return out

    def _verify(self, lease: ReadLease, ptrs: Sequence[int], out: list[int],
                first: int = 0) -> None:
        """Check the copies of ``lease``'s objects (the batch's ``first`` onwards)."""
        if not self.cfg.verify_checksums:
            return
        for i, want in enumerate(lease.checksums):
            j = first + i
            if out[j] > 0 and want is not None and not lease.verified(i, ptrs[j]):
                log.warning("checksum mismatch for %s: treating as missing", lease.keys[i])
                out[j] = ERR_CORRUPT

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
