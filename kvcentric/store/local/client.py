"""``LocalStore``: the embedded shared-memory backend, client side.

Every process maps the coordinator's arena file (tmpfs) and copies bytes itself with one
``memmove`` per object; the coordinator only allocates, leases and commits. So a put or a
get costs one memcpy plus two small round trips per batch, and engines on one node share
physical pages.

Ownership: memory behind caller ``ptrs`` is the caller's. ``WriteSlot.ptr`` and
``ReadLease.ptrs`` point into the shared arena and are valid only until commit/abort and
release respectively.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
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
from kvcentric.store.local import launcher
from kvcentric.store.local.disk_reads import READ_THREADS, DiskReads
from kvcentric.store.local.rpc import RpcClient
from kvcentric.store.local.shared_index import SharedIndexReader

if TYPE_CHECKING:
    from kvcentric.cuda.pinning import HostPinner

log = logging.getLogger("kvcentric.store")


class _Arena:
    """A mapping of the coordinator's arena file; ``base`` is its address here."""

    def __init__(self, path: str, capacity: int, arena_id: str, prefault: bool) -> None:
        fd = os.open(path, os.O_RDWR)
        # MAP_POPULATE maps every page now: a first touch later would cost a page fault
        # per 4 KiB inside the copy, which halves put bandwidth on a fresh mapping.
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
        try:
            self.mm = mmap.mmap(fd, capacity, flags)
        finally:
            os.close(fd)
        self._anchor: Any = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(self._anchor)
        self.capacity = capacity
        self.arena_id = arena_id

    def close(self) -> None:
        self._anchor = None
        try:
            self.mm.close()
        except BufferError:  # a view handed to a caller is still alive; the GC will unmap
            pass


class LocalStore(KVStore):
    """Client of a local store; starts the coordinator on first use when ``autostart``."""

    def __init__(self, cfg: StoreConfig, required: bool = True) -> None:
        self.cfg = cfg
        self._rpc = RpcClient(cfg.socket_path, cfg.op_timeout_s)
        self._arena: _Arena | None = None
        self._arena_gen = -1
        self._retry_at = 0.0
        self._index: SharedIndexReader | None = None
        self._lease_ttl_s = 0.0
        self._disk_tier = False  # the coordinator runs a disk tier (its hello says)
        self._pinner: HostPinner | None = None
        self._read_pool: ThreadPoolExecutor | None = None  # disk-tier reads, made on first use
        try:
            self._connect()
        except StoreUnavailable as exc:
            if required:
                raise
            log.warning("store %r unavailable (%s); serving by recompute until it is back",
                        cfg.name, exc)

    # ---- connection management ----
    def _connect(self) -> None:
        """(Re)connect, starting the coordinator if allowed. Every failure is
        ``StoreUnavailable``; after one, calls fail fast for ``reconnect_interval_s`` so a
        coordinator that cannot be (re)started never stalls each engine step."""
        now = time.monotonic()
        if now < self._retry_at:
            raise StoreUnavailable(f"store {self.cfg.name!r} unavailable; next reconnect "
                                   f"attempt in {self._retry_at - now:.1f} s")
        try:
            if self.cfg.autostart:
                launcher.ensure_running(self.cfg)
            hello = self._rpc.call("hello")
            if self._arena is None or self._arena.arena_id != hello["arena_id"]:
                self._close_arena()
                self._arena = _Arena(hello["arena"], hello["capacity"], hello["arena_id"],
                                     self.cfg.prefault)
                if self._pinner is not None:
                    self._pinner.register(self._arena.base, self._arena.capacity)
            self._open_index(hello.get("index"))
            self._lease_ttl_s = float(hello.get("lease_ttl_s") or 0.0)
            # a coordinator that does not say predates the residency op
            self._disk_tier = bool(hello.get("disk_tier", False))
        except (StoreUnavailable, OSError, ValueError) as exc:
            self._rpc.close()
            self._retry_at = time.monotonic() + self.cfg.reconnect_interval_s
            if isinstance(exc, StoreUnavailable):
                raise
            raise StoreUnavailable(f"cannot open store {self.cfg.name!r}: {exc}") from exc
        self._arena_gen = self._rpc.generation

    def _open_index(self, path: str | None) -> None:
        """Map the coordinator's shared lookup index (a new one after every reconnect:
        a restarted coordinator writes a new file)."""
        if self._index is not None:
            self._index.close()
            self._index = None
        if path and self.cfg.shared_index:
            try:
                self._index = SharedIndexReader(Path(path))
            except (OSError, ValueError) as exc:
                log.warning("shared lookup index unusable (%s); lookups use the socket", exc)

    def _call(self, op: str, *args: Any) -> Any:
        """One round trip; reconnects (and restarts the coordinator) after a failure."""
        if not self._rpc.connected:
            self._connect()
        return self._rpc.call(op, *args)

    @property
    def arena(self) -> _Arena:
        if self._arena is None or self._rpc.generation != self._arena_gen:
            self._connect()
        assert self._arena is not None
        return self._arena

    def arena_view(self, ptr: int, size: int) -> memoryview:
        """A writable memoryview of ``size`` arena bytes at ``ptr`` (from a slot or lease)."""
        off = ptr - self.arena.base
        if off < 0 or off + size > self.arena.capacity:
            raise ValueError("pointer is not inside the arena")
        return memoryview(self.arena.mm)[off : off + size]

    # ---- KVStore ----
    def batch_exists(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        index = self._index
        if index is not None and self._arena_gen == self._rpc.generation and self._rpc.peer_alive():
            n = index.leading_run(keys)
            if n is not None:
                return n
        try:
            return int(self._call("exists", list(keys)))
        except StoreUnavailable:
            return 0

    def batch_residency(self, keys: Sequence[str]) -> Residency:
        """With a disk tier: the coordinator's exact answer, one round trip (the shared
        index does not record tiers). Without one nothing is on disk: ``batch_exists``
        (the shared index, no round trip). An unreachable store holds nothing (run 0)."""
        if not keys:
            return Residency(0)
        try:
            if not self._rpc.connected:
                self._connect()
            if not self._disk_tier:
                return Residency(self.batch_exists(keys))
            run, disk_only = self._call("residency", list(keys))
        except StoreUnavailable:
            return Residency(0)
        return Residency(int(run), tuple(int(i) for i in disk_only))

    def batch_alloc(self, keys: Sequence[str], sizes: Sequence[int],
                    parents: Sequence[str | None] | None = None) -> list[WriteSlot | None]:
        return self._reserve(keys, sizes, parents)[0]

    def _reserve(self, keys: Sequence[str], sizes: Sequence[int],
                 parents: Sequence[str | None] | None) -> tuple[list[WriteSlot | None], list[int]]:
        """Slots for new keys (None where the key exists or space ran out) and reserve codes."""
        if len(keys) != len(sizes) or (parents is not None and len(parents) != len(keys)):
            raise ValueError("keys, sizes and parents must have equal lengths")
        if not keys:
            return [], []
        arena = self.arena
        gen = self._rpc.generation
        codes = self._call("reserve", list(keys), [int(s) for s in sizes],
                           list(parents) if parents is not None else [None] * len(keys))
        slots = [WriteSlot(k, arena.base + off, int(s), gen) if off >= 0 else None
                 for k, s, off in zip(keys, sizes, codes)]
        return slots, codes

    def batch_commit(self, slots: Sequence[WriteSlot], pin_s: float = 0.0) -> list[int]:
        if not slots:
            return []
        if any(s.handle != self._rpc.generation for s in slots):
            return [ERR_UNAVAILABLE] * len(slots)  # reconnected: those slots were reclaimed
        sums = [checksum(s.ptr, s.size) if self.cfg.verify_checksums else None for s in slots]
        try:
            return list(self._call("commit", [s.key for s in slots], sums, float(pin_s)))
        except StoreUnavailable:
            return [ERR_UNAVAILABLE] * len(slots)

    def batch_abort(self, slots: Sequence[WriteSlot]) -> None:
        live = [s.key for s in slots if s.handle == self._rpc.generation]
        if live:
            try:
                self._call("abort", live)
            except StoreUnavailable:
                pass  # the coordinator reclaims them with the connection

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
        through :meth:`fetch_range` (docs/architecture.md §4.5)."""
        return self._acquire(keys, eager=False)

    def _acquire(self, keys: Sequence[str], eager: bool) -> ReadLease:
        if not keys:
            return ReadLease([], [], [], [], None)
        arena = self.arena
        gen = self._rpc.generation
        asked = time.monotonic()
        lease_id, entries = self._call("acquire", list(keys))
        # the coordinator reclaims the lease lease_ttl_s after it granted it, which is
        # after we asked: treating it as lapsed from asked + ttl is always on the safe side
        deadline = asked + self._lease_ttl_s if self._lease_ttl_s > 0 else float("inf")
        reads = (DiskReads(len(entries), self._disk_pool()) if any(len(e) > 3 for e in entries)
                 else None)
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
        return ReadLease(list(keys[:n]), ptrs[:n], [e[1] for e in entries[:n]],
                         [e[2] for e in entries[:n]], (lease_id, gen, deadline, reads, n))

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
        except OSError as exc:
            raise StoreUnavailable(f"disk-tier read failed: {exc}") from exc

    def release(self, lease: ReadLease) -> None:
        if lease.handle is None:
            return
        lease_id, gen, _, reads, _ = lease.handle
        lease.handle = None
        live = lease_id and gen == self._rpc.generation
        if reads is not None:
            codes = reads.codes()
            reads.close()
            if live:
                self._rpc.send("settle", lease_id, codes)
        elif live:
            self._rpc.send("release", lease_id)

    def lease_valid(self, lease: ReadLease) -> bool:
        """False when the connection dropped since ``lease`` was taken, or its TTL ran out
        (either way the coordinator reclaimed it and its bytes may have been reused), or
        when an object read from the disk tier is incomplete or fails its checksum."""
        if lease.handle is None:
            return False
        _, gen, deadline, reads, n = lease.handle
        if reads is not None and not reads.verified(n):
            return False
        return gen == self._rpc.generation and time.monotonic() < deadline

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
        return int(self._call("remove", key, force))

    def list_keys(self, prefix: str = "", limit: int = 1000) -> list[str]:
        """Committed keys that start with ``prefix`` (for inspection and tests)."""
        return list(self._call("keys", prefix, limit))

    def clear(self) -> int:
        """Remove every unleased object; returns how many."""
        return int(self._call("clear"))

    def stats(self) -> dict[str, Any]:
        return dict(self._call("stats"))

    def pin_host_memory(self, pinner: HostPinner) -> None:
        self._pinner = pinner
        if self._arena is not None:
            pinner.register(self._arena.base, self._arena.capacity)

    def _close_arena(self) -> None:
        """Unmap the arena, unregistering it from CUDA first (a registered range must
        never outlive its mapping)."""
        if self._arena is None:
            return
        if self._pinner is not None:
            self._pinner.unregister(self._arena.base)
        self._arena.close()
        self._arena = None

    def close(self) -> None:
        if self._read_pool is not None:  # no read may land in the arena after it is unmapped
            self._read_pool.shutdown(wait=True, cancel_futures=True)
            self._read_pool = None
        self._rpc.close()
        if self._index is not None:
            self._index.close()
            self._index = None
        self._close_arena()
