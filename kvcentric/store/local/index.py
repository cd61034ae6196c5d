"""Object index of the local store: states, leases, prefix chains and leaf-first LRU eviction.

Runs inside the coordinator only; single-threaded. An object is PENDING from ``alloc`` until
``commit`` (invisible to every reader) and COMMITTED after. Committed objects are immutable.

Eviction (docs/store.md §Local store): LRU over *leaves* of prefix chains. A child is linked to its
parent when committed; a parent with resident children is not evictable, because a child is
useless without its ancestors, and a prefix lookup touches a parent before its children,
so a parent is never younger than its children. When a parent's last child is evicted, the
parent becomes a leaf at the cold end of the LRU. Objects under a read lease are skipped,
and so are soft-pinned ones: a P/D prefill commits its blocks pinned for ``pin_s`` seconds,
until the first read (the decode loading them) or the deadline, whichever comes first, so
eviction pressure between the handoff's save and load cannot turn it into a recompute. A
put that finds only leased or pinned objects to evict is refused (``ERR_NO_SPACE``).
Pins are capped per client (``pin_cap`` bytes per owner, a connection): a pin past the cap
is refused (the object is committed unpinned, counted ``pins_refused``), and the pins of a
client that disconnects lapse with it, so pinned bytes never exceed ``pin_cap`` per
connected client.

A child committed before its parent (two requests racing on one prefix) is an orphan
until the parent commits; then it is linked. Each entry knows its depth and whether its
whole ancestry is committed, which the shared lookup index publishes
(:mod:`kvcentric.store.local.shared_index`).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcentric.store.allocator import ExtentAllocator
from kvcentric.store.base import (
    ERR_EXISTS,
    ERR_HAS_LEASE,
    ERR_INVALID,
    ERR_NO_SPACE,
    ERR_NOT_FOUND,
    OK,
)
from kvcentric.store.local.events import CPU, DISK, StoreEvents
from kvcentric.store.local.shared_index import SharedIndexWriter

PENDING, COMMITTED = 0, 1


@dataclass(eq=False)
class Entry:
    key: str
    offset: int
    size: int
    owner: int
    parent: str | None
    state: int = PENDING
    readers: int = 0
    checksum: int | None = None
    removed: bool = False  # dropped from the index while leased; freed at last release
    parent_entry: Entry | None = None  # linked at commit; identity guards against key reuse
    kids: list[Entry] = field(default_factory=list)  # committed children linked to this one
    depth: int = 0  # linked ancestors
    complete: bool = False  # every ancestor back to a parentless root is committed
    # disk tier (kvcentric.store.local.tiered); offset is -1 while the object is on disk only
    disk_path: str | None = None  # its complete, fsynced file
    disk_checksum: int = 0
    demoting: bool = False  # a disk write of its DRAM bytes is in flight (they are pinned)
    promo: int = -1  # DRAM extent a reader fills from disk, published at settle
    pinned_until: float = 0.0  # soft pin (monotonic deadline); cleared by the first read
    pin_owner: int = -1  # the client whose pin budget the pin counts against

    def evictable(self, now: float) -> bool:
        return self.readers == 0 and self.pinned_until <= now

    @property
    def children(self) -> int:
        return len(self.kids)


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_bytes: int = 0
    gets: int = 0
    get_bytes: int = 0
    evictions: int = 0
    rejected_puts: int = 0
    lookups: int = 0  # answered by the coordinator; shared-index lookups are not counted
    expired_leases: int = 0
    pinned: int = 0  # objects committed with a soft pin
    pins_refused: int = 0  # pins past a client's cap (committed unpinned)


@dataclass
class Lease:
    entries: list[Entry] = field(default_factory=list)
    owner: int = 0
    since: float = 0.0  # time.monotonic() when granted (the clock every process shares)


class ObjectIndex:
    """All metadata of one arena. ``owner`` ids identify client connections."""

    def __init__(self, capacity: int, shared: SharedIndexWriter | None = None,
                 pin_cap: int | None = None) -> None:
        self.alloc = ExtentAllocator(capacity)
        self.pin_cap = capacity if pin_cap is None else pin_cap
        self._pins: dict[int, dict[str, Entry]] = {}  # owner -> its pinned entries
        self._pinned_bytes: dict[int, int] = {}
        self.shared = shared
        self.events: StoreEvents | None = None  # the coordinator's KV event publisher
        self.entries: dict[str, Entry] = {}
        self._orphans: dict[str, list[Entry]] = {}  # parent key -> committed, unlinked children
        self._leaves: OrderedDict[str, Entry] = OrderedDict()  # evictable candidates, LRU first
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self.counters = Counters()

    # ---- writes ----
    def reserve(self, key: str, size: int, parent: str | None, owner: int) -> int:
        """Reserve a PENDING object; returns its offset, or ERR_EXISTS / ERR_NO_SPACE."""
        if size <= 0 or size > self.alloc.capacity:
            return ERR_INVALID
        if key in self.entries:
            return ERR_EXISTS
        offset = self.alloc.alloc(size)
        while offset is None and self._evict_one():
            offset = self.alloc.alloc(size)
        if offset is None:
            self.counters.rejected_puts += 1
            return ERR_NO_SPACE
        self.entries[key] = Entry(key, offset, size, owner, parent)
        return offset

    def commit(self, key: str, owner: int, checksum: int | None, pin_s: float = 0.0) -> int:
        """Make a PENDING object visible; ``pin_s`` > 0 soft-pins it (module docstring)."""
        e = self.entries.get(key)
        if e is None or e.state != PENDING or e.owner != owner:
            return ERR_NOT_FOUND
        e.state, e.checksum = COMMITTED, checksum
        if pin_s > 0:
            self._pin(e, owner, pin_s)
        parent = self.entries.get(e.parent) if e.parent else None
        if parent is not None and parent.state == COMMITTED:
            self._link(parent, e)
        else:
            e.complete = e.parent is None
            if e.parent is not None:
                self._orphans.setdefault(e.parent, []).append(e)
        self._leaves[key] = e
        self._publish(e)
        if self.events is not None:  # a disk-only object recovered at restart is on disk
            self.events.stored(e, CPU if e.offset >= 0 else DISK)
        for orphan in self._orphans.pop(key, []):
            self._link(e, orphan)
            self._update_subtree(orphan)
        self.counters.puts += 1
        self.counters.put_bytes += e.size
        return OK

    def _pin(self, e: Entry, owner: int, pin_s: float) -> None:
        """Pin ``e`` for ``pin_s`` within ``owner``'s budget, or count the refusal."""
        now = time.monotonic()
        held = self._pinned_bytes.get(owner, 0)
        if held + e.size > self.pin_cap:  # pins past their deadline still count: drop them
            for old in [p for p in self._pins.get(owner, {}).values() if p.pinned_until <= now]:
                self._unpin(old)
            held = self._pinned_bytes.get(owner, 0)
        if held + e.size > self.pin_cap:
            self.counters.pins_refused += 1
            return
        e.pinned_until, e.pin_owner = now + pin_s, owner
        self._pins.setdefault(owner, {})[e.key] = e
        self._pinned_bytes[owner] = held + e.size
        self.counters.pinned += 1

    def _unpin(self, e: Entry) -> None:
        owner, e.pin_owner, e.pinned_until = e.pin_owner, -1, 0.0
        pins = self._pins.get(owner)
        if pins is not None and pins.pop(e.key, None) is e:
            self._pinned_bytes[owner] -= e.size
            if not pins:
                del self._pins[owner], self._pinned_bytes[owner]

    def _link(self, parent: Entry, child: Entry) -> None:
        parent.kids.append(child)
        self._leaves.pop(parent.key, None)
        child.parent_entry = parent
        child.depth, child.complete = parent.depth + 1, parent.complete

    def _update_subtree(self, root: Entry) -> None:
        """Recompute depth/completeness below ``root`` (already set) and republish."""
        stack = [root]
        while stack:
            e = stack.pop()
            self._publish(e)
            for kid in e.kids:
                kid.depth, kid.complete = e.depth + 1, e.complete
                stack.append(kid)

    def _publish(self, e: Entry) -> None:
        if self.shared is not None:
            self.shared.put(e.key, e.depth, e.complete, e.parent)

    def abort(self, key: str, owner: int) -> None:
        e = self.entries.get(key)
        if e is not None and e.state == PENDING and e.owner == owner:
            del self.entries[key]
            self.alloc.free(e.offset, e.size)

    # ---- reads ----
    def leading_run(self, keys: Sequence[str]) -> int:
        self.counters.lookups += 1
        n = 0
        for k in keys:
            e = self.entries.get(k)
            if e is None or e.state != COMMITTED:
                break
            n += 1
        return n

    def residency(self, keys: Sequence[str]) -> tuple[int, list[int]]:
        """``(leading_run(keys), positions in that run of objects not in DRAM)``; only the
        disk tier (:class:`~kvcentric.store.local.tiered.TieredIndex`) has such objects
        (``offset`` -1), so without it the list is empty."""
        n = self.leading_run(keys)
        entries = self.entries
        return n, [i for i in range(n) if entries[keys[i]].offset < 0]

    def acquire(self, keys: Sequence[str], owner: int) -> tuple[int, list[Entry]]:
        """Lease the leading run of committed ``keys``; returns (lease id, entries)."""
        got: list[Entry] = []
        for k in keys:
            e = self.entries.get(k)
            if e is None or e.state != COMMITTED:
                break
            e.readers += 1
            if e.pin_owner >= 0:  # read: the handoff it was pinned for is done
                self._unpin(e)
            if k in self._leaves:
                self._leaves.move_to_end(k)
            got.append(e)
        c = self.counters
        c.hits += len(got)
        c.misses += len(keys) - len(got)
        c.gets += len(got)
        c.get_bytes += sum(e.size for e in got)
        if not got:
            return 0, got
        lease_id = next(self._lease_ids)
        self._leases[lease_id] = Lease(got, owner, time.monotonic())
        return lease_id, got

    def expire_leases(self, granted_before: float) -> int:
        """Release every lease granted before ``granted_before``; returns how many. A late
        release by the holder is ignored; the client library treats its lease as lapsed
        from the same deadline (``lease_ttl_s`` after it asked)."""
        old = [(lid, lease.owner) for lid, lease in self._leases.items()
               if lease.since < granted_before]
        for lid, owner in old:
            self.release(lid, owner)
        self.counters.expired_leases += len(old)
        return len(old)

    def release(self, lease_id: int, owner: int) -> None:
        lease = self._leases.get(lease_id)
        if lease is None or lease.owner != owner:
            return
        del self._leases[lease_id]
        for e in lease.entries:
            e.readers -= 1
            if e.removed and e.readers == 0:
                self._free(e)

    # ---- removal and eviction ----
    def remove(self, key: str, force: bool = False) -> int:
        e = self.entries.get(key)
        if e is None or e.state != COMMITTED:
            return ERR_NOT_FOUND
        if e.readers and not force:
            return ERR_HAS_LEASE
        self._drop(e)
        return OK

    def _drop(self, e: Entry) -> None:
        del self.entries[e.key]
        if self.events is not None:
            if e.offset >= 0:
                self.events.removed(e.key, CPU)
            if e.disk_path is not None:
                self.events.removed(e.key, DISK)
        if e.pin_owner >= 0:
            self._unpin(e)
        self._leaves.pop(e.key, None)
        if self.shared is not None:
            self.shared.delete(e.key)
        parent = e.parent_entry
        if parent is not None and self.entries.get(parent.key) is parent:
            parent.kids.remove(e)
            if not parent.kids:
                self._leaves[parent.key] = parent
                self._leaves.move_to_end(parent.key, last=False)
        elif e.parent is not None and e in self._orphans.get(e.parent, ()):
            self._orphans[e.parent].remove(e)
            if not self._orphans[e.parent]:
                del self._orphans[e.parent]
        for kid in e.kids:  # an inner object removed: its subtree waits for it again
            kid.parent_entry, kid.depth, kid.complete = None, 0, False
            self._update_subtree(kid)
            self._orphans.setdefault(e.key, []).append(kid)
        e.kids = []
        if e.readers:
            e.removed = True  # freed when the last reader releases
        else:
            self._free(e)

    def _free(self, e: Entry) -> None:
        """Give back the storage of a dropped, unleased object."""
        self.alloc.free(e.offset, e.size)

    def lease_reply(self, lease_id: int, entries: list[Entry]) -> list[Any]:
        """What a client needs to read ``entries`` of lease ``lease_id``: one
        ``[offset, size, checksum]`` per object."""
        return [[e.offset, e.size, e.checksum] for e in entries]

    def _evict_one(self) -> bool:
        now = time.monotonic()
        for e in self._leaves.values():
            if e.evictable(now):
                self._drop(e)
                self.counters.evictions += 1
                return True
        return False

    def list_keys(self, prefix: str, limit: int) -> list[str]:
        """Committed keys starting with ``prefix`` (at most ``limit``, unordered)."""
        out = []
        for key, e in self.entries.items():
            if e.state == COMMITTED and key.startswith(prefix):
                out.append(key)
                if len(out) >= limit:
                    break
        return out

    def clear(self) -> int:
        """Remove every committed, unleased object; returns how many."""
        victims = [e for e in self.entries.values() if e.state == COMMITTED and not e.readers]
        for e in victims:
            self._drop(e)
        return len(victims)

    def drop_owner(self, owner: int) -> tuple[int, int]:
        """Reclaim a gone client's leases and pending writes and end its pins; returns
        (leases, pendings)."""
        for e in list(self._pins.get(owner, {}).values()):
            self._unpin(e)
        lease_ids = [lid for lid, lease in self._leases.items() if lease.owner == owner]
        for lid in lease_ids:
            self.release(lid, owner)
        pending = [e.key for e in self.entries.values() if e.state == PENDING and e.owner == owner]
        for key in pending:
            self.abort(key, owner)
        return len(lease_ids), len(pending)

    def stats(self) -> dict[str, int]:
        committed = sum(1 for e in self.entries.values() if e.state == COMMITTED)
        return {
            "capacity_bytes": self.alloc.capacity,
            "used_bytes": self.alloc.used,
            "keys": committed,
            "pending": len(self.entries) - committed,
            "leases": len(self._leases),
            **vars(self.counters),
        }
