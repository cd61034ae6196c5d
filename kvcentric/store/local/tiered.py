"""``TieredIndex``: the object index of a local store with a disk tier (docs/store.md §Disk tier).

An object lives in DRAM (``offset >= 0``), on disk (``disk_path``), or both. In DRAM it is
*dirty* (no disk copy yet), *demoting* (a disk write of its bytes is in flight; the bytes are
pinned) or *clean* (its disk copy is complete and fsynced). Objects move DRAM -> disk -> gone:

- **Demotion** is write-back and asynchronous. When dirty bytes exceed ``high_watermark`` of
  DRAM, or a writer is held back (below), :meth:`pump` hands the coldest dirty objects to
  the I/O threads (``submit``); their completion (:meth:`demoted`) makes them clean.
- **DRAM eviction** (a ``reserve`` that needs room) drops the DRAM copy of a clean object,
  leaves of prefix chains first; that loses nothing.
- **Writers held back: nothing committed is lost while the disk has room.** While the disk
  takes writes, a committed object with no disk copy (dirty or demoting: *un-demoted*) is
  never dropped. Instead a ``reserve(hold=True)`` answers :data:`HOLD` when un-demoted
  bytes are at ``dirty_limit`` of DRAM or when room could only be made by dropping an
  un-demoted object; the coordinator parks that request (off its loop,
  :mod:`kvcentric.store.local.holdback`) and retries it as demotions complete, for at most
  ``put_wait_s``. Then it asks once more with ``hold=False``: the bound is waived, room is
  made from free space and clean copies only, and what still does not fit is refused
  (``ERR_NO_SPACE``, counted in ``rejected_puts`` and ``refused_undemoted``: never
  committed, so never readable). ``put_waits``/``put_wait_ms`` count the waits.
- **When the disk has no room** (a demotion found no space and no disk-only leaf to evict,
  or the kernel said ENOSPC/EFBIG/EDQUOT, or a write failed: ``disk_full``/``disk_errors``),
  demotion pauses for ``BACKOFF_S`` and for that long the tier is a DRAM-only cache again:
  nobody is held back, and a reserve that finds no clean copy drops the coldest dirty chain
  leaf outright (the order a DRAM-only store evicts in), counted ``dropped_undemoted``.
  ``dropped_undemoted`` therefore stays 0 for as long as every demotion finds room
  (tests/store/test_store_demotion.py).
- **Disk eviction** (a demotion that needs room on disk) removes the least recently used
  disk-only *leaf*, which is then gone (``disk_evictions``).
- **Reads**: ``acquire`` leases both tiers. A disk-only object is read by the client straight
  from its file, range by range, into a DRAM extent reserved here (``promo``), when one can
  be had without dropping a dirty object. At ``settle`` the client reports each object it
  read whole and verified (promoted: the extent becomes its DRAM copy), corrupt or missing
  (the disk copy is dropped, and the object with it if that was its only copy).
- **Restart**: the I/O threads scan the tier's files and verify them; :meth:`recovered`
  inserts each verified object as committed and disk-only.

Runs in the coordinator's loop thread only, like :class:`ObjectIndex`. ``submit`` takes a
:class:`~kvcentric.store.local.demoter.WriteJob` or a ``Path`` to unlink, and must not block.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcentric.store.base import ERR_EXISTS, ERR_INVALID, ERR_NO_SPACE, OK
from kvcentric.store.local import disk
from kvcentric.store.local.demoter import Recovered, RecoveryDone, WriteDone, WriteJob
from kvcentric.store.local.events import CPU, DISK
from kvcentric.store.local.index import Entry, ObjectIndex
from kvcentric.store.local.shared_index import SharedIndexWriter
from kvcentric.store.local.wire import CORRUPT, MISSING, PROMOTE  # settle codes

HOLD = -201  # reserve: wait for the demoter; the coordinator's own, never sent to a client
MAX_IN_FLIGHT = 32  # demotions queued at once: pinned bytes cannot be evicted meanwhile
VICTIM_SCAN = 64  # clean copies looked at for a chain leaf before taking any clean copy
BACKOFF_S = 1.0  # after a failed disk write, no demotion for this long
WANTED_S = 0.1  # after a writer found no room, demote every dirty object for this long


@dataclass
class TierCounters:
    dram_hits: int = 0
    disk_hits: int = 0
    demotions: int = 0
    promotions: int = 0
    dram_evictions: int = 0  # objects that left DRAM (``evictions`` counts every tier's)
    disk_evictions: int = 0  # disk-only objects removed for disk space (gone)
    dropped_undemoted: int = 0  # dropped from DRAM with no disk copy (only while disk has no room)
    put_waits: int = 0  # reserve requests held back for the demoter
    put_wait_ms: int = 0  # time they waited, in total
    refused_undemoted: int = 0  # objects refused, the disk having room: demotion was behind
    disk_write_bytes: int = 0
    disk_read_bytes: int = 0  # bytes of disk-resident objects leased to readers
    disk_full: int = 0  # demotions refused: no disk space, or ENOSPC/EFBIG from the kernel
    disk_errors: int = 0  # demotions failed for other I/O errors
    disk_corrupt: int = 0  # disk copies a reader found corrupt (dropped)
    disk_missing: int = 0  # disk copies a reader could not open (dropped)
    recovered: int = 0  # objects served again after a restart
    recovery_dropped: int = 0  # torn or corrupt files deleted at restart


class TieredIndex(ObjectIndex):
    def __init__(self, capacity: int, disk_capacity: int, root: Path, high_watermark: float,
                 submit: Callable[[Any], None], shared: SharedIndexWriter | None = None,
                 dirty_limit: float = 1.0, pin_cap: int | None = None) -> None:
        super().__init__(capacity, shared, pin_cap)
        self.root = root
        self.disk_capacity = disk_capacity
        self.disk_used = 0
        self.disk_objects = 0
        self.high_watermark = high_watermark
        self.dirty_limit = dirty_limit
        self.submit = submit
        self.tiers = TierCounters()
        self.recovering = False
        self._dirty: OrderedDict[str, Entry] = OrderedDict()  # LRU first
        self._clean: OrderedDict[str, Entry] = OrderedDict()  # LRU first
        self._dirty_bytes = 0
        self._demoting = 0
        self._demoting_bytes = 0
        self._wanted_until = 0.0  # a writer waits for room: demote regardless of watermark
        self._promos: dict[int, list[Entry]] = {}
        self._backoff_until = 0.0
        self._tag = secrets.token_hex(4)
        self._seq = itertools.count()

    # ---- writes and eviction ----
    def reserve(self, key: str, size: int, parent: str | None, owner: int,
                hold: bool = False) -> int:
        """The base's reserve, except that while the disk has room no un-demoted object is
        dropped for it: ``hold`` answers :data:`HOLD` instead (wait and ask again), else
        ``ERR_NO_SPACE`` (module docstring)."""
        if size <= 0 or size > self.alloc.capacity:
            return ERR_INVALID
        if key in self.entries:
            return ERR_EXISTS
        now = time.monotonic()
        room = not self.disk_stalled(now)
        if hold and room and self.undemoted_bytes() >= self.dirty_limit * self.alloc.capacity:
            self._wanted_until = now + WANTED_S
            return HOLD
        offset = self.alloc.alloc(size)
        while offset is None and self._evict_one(drop_dirty=not room):
            offset = self.alloc.alloc(size)
        if offset is None:
            if room and self.undemoted_bytes():  # demotion will make clean copies to drop
                self._wanted_until = now + WANTED_S
                if hold:
                    return HOLD
                self.tiers.refused_undemoted += 1
            self.counters.rejected_puts += 1
            return ERR_NO_SPACE
        self.entries[key] = Entry(key, offset, size, owner, parent)
        return offset

    def disk_stalled(self, now: float) -> bool:
        """True while demotion pauses after the disk had no room (or failed)."""
        return now < self._backoff_until

    def undemoted_bytes(self) -> int:
        """Committed DRAM bytes with no disk copy (dirty or being written)."""
        return self._dirty_bytes + self._demoting_bytes

    def commit(self, key: str, owner: int, checksum: int | None, pin_s: float = 0.0) -> int:
        code = super().commit(key, owner, checksum, pin_s)
        e = self.entries[key] if code == OK else None
        if e is not None and e.offset >= 0:
            self._dirty[key] = e
            self._dirty_bytes += e.size
        return code

    def _evict_one(self, drop_dirty: bool = True) -> bool:
        """Make DRAM room: drop a clean copy (a pinned object keeps its disk copy), else,
        with ``drop_dirty`` (the disk has no room), a dirty, unpinned chain leaf outright
        (counted)."""
        if self._drop_clean():
            return True
        e = self._dirty_victim(time.monotonic()) if drop_dirty else None
        if e is None:
            return False
        self._drop(e)
        self.counters.evictions += 1
        self.tiers.dram_evictions += 1
        self.tiers.dropped_undemoted += 1
        return True

    def _dirty_victim(self, now: float) -> Entry | None:
        for e in self._leaves.values():
            if e.evictable(now) and not e.demoting and e.offset >= 0 and e.disk_path is None:
                return e
        return None

    def _drop_clean(self) -> bool:
        first = None
        for i, e in enumerate(self._clean.values()):
            if i >= VICTIM_SCAN and first is not None:
                break
            if e.readers:
                continue
            if not any(k.offset >= 0 for k in e.kids):
                first = e
                break
            first = first or e
        if first is None:
            return False
        self._leave_dram(first)
        return True

    def _leave_dram(self, e: Entry) -> None:
        if self.events is not None:
            self.events.removed(e.key, CPU)
        del self._clean[e.key]
        self.alloc.free(e.offset, e.size)
        e.offset = -1
        self.counters.evictions += 1
        self.tiers.dram_evictions += 1

    def _drop(self, e: Entry) -> None:
        if self._dirty.pop(e.key, None) is not None:
            self._dirty_bytes -= e.size
        self._clean.pop(e.key, None)
        super()._drop(e)

    def _free(self, e: Entry) -> None:
        if e.demoting:
            e.removed = True  # demoted() frees it once the write is done
            return
        if e.offset >= 0:
            self.alloc.free(e.offset, e.size)
            e.offset = -1
        if e.promo >= 0:
            self.alloc.free(e.promo, e.size)
            e.promo = -1
        if e.disk_path is not None:
            self.disk_used -= disk.footprint(e.size)
            self.disk_objects -= 1
            self.submit(Path(e.disk_path))
            e.disk_path = None

    # ---- demotion ----
    def pump(self, now: float) -> None:
        """Queue demotions of the coldest dirty objects while dirty bytes are above the
        watermark, or any while a writer waits for room (at most ``MAX_IN_FLIGHT`` in
        flight; none while backing off)."""
        limit = self._pump_limit(now)
        while (self._dirty and self._dirty_bytes > limit and self._demoting < MAX_IN_FLIGHT
               and now >= self._backoff_until):
            key, e = next(iter(self._dirty.items()))
            if not self._reserve_disk(disk.footprint(e.size)):
                self.tiers.disk_full += 1
                self._backoff_until = now + BACKOFF_S
                return
            del self._dirty[key]
            self._dirty_bytes -= e.size
            e.demoting = True
            self._demoting += 1
            self._demoting_bytes += e.size
            path = disk.object_path(self.root, key, f"{self._tag}{next(self._seq):x}")
            self.submit(WriteJob(e, key, e.parent, e.offset, e.size, path))

    def needs_pump(self, now: float) -> bool:
        return (self._dirty_bytes > self._pump_limit(now)
                and now >= self._backoff_until and self._demoting < MAX_IN_FLIGHT)

    def _pump_limit(self, now: float) -> float:
        return 0.0 if now < self._wanted_until else self.high_watermark * self.alloc.capacity

    def _reserve_disk(self, need: int) -> bool:
        if need > self.disk_capacity:
            return False
        while self.disk_used + need > self.disk_capacity:
            victim = next((e for e in self._leaves.values() if e.offset < 0 and e.readers == 0
                           and e.disk_path is not None), None)
            if victim is None:
                return False
            self._drop(victim)
            self.counters.evictions += 1
            self.tiers.disk_evictions += 1
        self.disk_used += need
        return True

    def apply(self, result: Any, now: float) -> None:
        """Apply one result of the I/O threads."""
        if isinstance(result, WriteDone):
            self.demoted(result, now)
        elif isinstance(result, Recovered):
            self.recovered(result.header, result.path)
        elif isinstance(result, RecoveryDone):
            self.recovering = False
            self.tiers.recovery_dropped += result.dropped

    def demoted(self, done: WriteDone, now: float) -> None:
        e: Entry = done.token
        e.demoting = False
        self._demoting -= 1
        self._demoting_bytes -= e.size
        if done.ok:
            e.disk_checksum = done.checksum
            e.disk_path = str(done.path)
            self.disk_objects += 1
            self.tiers.demotions += 1
            self.tiers.disk_write_bytes += e.size
        else:
            self.disk_used -= disk.footprint(e.size)
            if done.full:
                self.tiers.disk_full += 1
            else:
                self.tiers.disk_errors += 1
            self._backoff_until = now + BACKOFF_S
        if e.removed or self.entries.get(e.key) is not e:
            if e.readers == 0:
                self._free(e)  # dropped while its bytes were being written
            return
        if done.ok:
            self._clean[e.key] = e
            if self.events is not None:
                self.events.stored(e, DISK)
        else:
            self._dirty[e.key] = e
            self._dirty.move_to_end(e.key, last=False)
            self._dirty_bytes += e.size

    def recovered(self, h: disk.Header, path: Path) -> None:
        """Insert a verified file found at restart as a committed, disk-only object."""
        fp = disk.footprint(h.size)
        if h.key in self.entries or self.disk_used + fp > self.disk_capacity:
            self.submit(path)  # a duplicate, or over a capacity that shrank
            return
        self.entries[h.key] = Entry(h.key, -1, h.size, -1, h.parent)
        super().commit(h.key, -1, h.checksum)
        e = self.entries[h.key]
        e.disk_path, e.disk_checksum = str(path), h.checksum
        self.disk_used += fp
        self.disk_objects += 1
        self.counters.puts -= 1
        self.counters.put_bytes -= h.size
        self.tiers.recovered += 1

    # ---- reads ----
    def acquire(self, keys: Sequence[str], owner: int) -> tuple[int, list[Entry]]:
        lease_id, got = super().acquire(keys, owner)
        promos = []
        for e in got:
            if e.offset >= 0:
                self.tiers.dram_hits += 1
                for lru in (self._dirty, self._clean):
                    if e.key in lru:
                        lru.move_to_end(e.key)
                continue
            self.tiers.disk_hits += 1
            self.tiers.disk_read_bytes += e.size
            if e.promo < 0:
                off = self.alloc.alloc(e.size)
                while off is None and self._drop_clean():
                    off = self.alloc.alloc(e.size)
                if off is not None:
                    e.promo = off
                    promos.append(e)
        if promos:
            self._promos[lease_id] = promos
        return lease_id, got

    def lease_reply(self, lease_id: int, entries: list[Entry]) -> list[Any]:
        """``[offset, size, checksum]`` for DRAM objects; ``[promo extent or -1, size,
        checksum, file, file checksum]`` for disk-only ones (the client reads the file)."""
        mine = {id(e) for e in self._promos.get(lease_id, ())}
        return [[e.offset, e.size, e.checksum] if e.offset >= 0 else
                [e.promo if id(e) in mine else -1, e.size, e.checksum, e.disk_path,
                 e.disk_checksum] for e in entries]

    def settle(self, lease_id: int, owner: int, codes: Sequence[int]) -> None:
        """Apply a reader's per-object report, then release the lease."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.owner != owner:
            return
        mine = {id(e) for e in self._promos.get(lease_id, ())}
        for e, code in zip(lease.entries, codes):
            live = self.entries.get(e.key) is e and not e.removed and e.offset < 0
            if code == PROMOTE and live and id(e) in mine:
                e.offset, e.promo = e.promo, -1
                self._clean[e.key] = e
                if self.events is not None:
                    self.events.stored(e, CPU)
                self.tiers.promotions += 1
            elif code in (CORRUPT, MISSING) and live:
                if code == CORRUPT:
                    self.tiers.disk_corrupt += 1
                else:
                    self.tiers.disk_missing += 1
                self._drop(e)
        self.release(lease_id, owner)

    def release(self, lease_id: int, owner: int) -> None:
        lease = self._leases.get(lease_id)
        if lease is not None and lease.owner == owner:
            for e in self._promos.pop(lease_id, ()):
                if e.promo >= 0:
                    self.alloc.free(e.promo, e.size)
                    e.promo = -1
        super().release(lease_id, owner)

    def stats(self) -> dict[str, int]:
        """The base stats (``used_bytes``/``capacity_bytes`` are DRAM's) plus the tiers';
        O(1) beyond the base's, so the coordinator can log them often."""
        return {**super().stats(),
                "dram_objects": len(self._dirty) + len(self._clean) + self._demoting,
                "dirty_bytes": self._dirty_bytes, "demoting": self._demoting,
                "disk_objects": self.disk_objects, "disk_used_bytes": self.disk_used,
                "disk_capacity_bytes": self.disk_capacity,
                "disk_recovering": int(self.recovering), **vars(self.tiers)}
