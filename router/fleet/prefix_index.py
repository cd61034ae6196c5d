"""Which instance holds which block: an inverted index of bitmasks with per-instance LRU.

Blocks are named by their chained hash (:func:`kvcentric.hashing.block_hashes`, the same
bytes the store keys end in), so one hash chain per request answers both "which instances
hold this prefix" and "is it in the store".

Matching a request is ``O(blocks)`` dictionary lookups whatever the number of instances:
one walk down the request's chain ANDs the owner bitmasks, and an instance's leading run
ends where its bit drops out. Residency comes from the engines' KV events where they
publish them (:mod:`kvcentric.router.fleet.kv_events`) and from the router's own bookkeeping (every
dispatched prompt's blocks), bounded by an LRU per instance so stale knowledge decays.

Single-threaded: call it from one thread (the router's event loop).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixIndex:
    """Owners of each block as a bitmask over instance slots (bit ``1 << slot``)."""

    def __init__(self) -> None:
        self._owners: dict[bytes, int] = {}
        self._lru: dict[int, OrderedDict[bytes, None]] = {}
        self._capacity: dict[int, int] = {}

    # ---- slots ----
    def add_slot(self, slot: int, capacity: int) -> None:
        if slot in self._lru:
            raise ValueError(f"slot {slot} is in use")
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self._lru[slot] = OrderedDict()
        self._capacity[slot] = capacity

    def drop_slot(self, slot: int) -> None:
        self.clear(slot)
        del self._lru[slot]
        del self._capacity[slot]

    def set_capacity(self, slot: int, capacity: int) -> None:
        """Resize an instance's LRU (e.g. once its engine reports its cache size)."""
        self._capacity[slot] = max(1, capacity)
        self._evict(slot)

    def capacity(self, slot: int) -> int:
        return self._capacity[slot]

    def resident(self, slot: int) -> int:
        """Blocks believed resident on ``slot``."""
        return len(self._lru[slot])

    # ---- updates ----
    def add(self, slot: int, hashes: Sequence[bytes]) -> None:
        """Mark a prefix chain (root first) resident on ``slot``, most recently used.

        Touched leaf first so the root ends up newest: LRU then evicts the deepest blocks
        first, never a parent before its children (a child is useless without it).
        """
        lru = self._lru[slot]
        bit = 1 << slot
        owners = self._owners
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                owners[h] = owners.get(h, 0) | bit
        self._evict(slot)

    def remove(self, slot: int, hashes: Iterable[bytes]) -> None:
        lru = self._lru[slot]
        for h in hashes:
            if h in lru:
                del lru[h]
                self._unset(h, slot)

    def clear(self, slot: int) -> None:
        lru = self._lru[slot]
        for h in lru:
            self._unset(h, slot)
        lru.clear()

    def _unset(self, h: bytes, slot: int) -> None:
        m = self._owners.get(h, 0) & ~(1 << slot)
        if m:
            self._owners[h] = m
        else:
            self._owners.pop(h, None)

    def _evict(self, slot: int) -> None:
        lru = self._lru[slot]
        cap = self._capacity[slot]
        while len(lru) > cap:
            h, _ = lru.popitem(last=False)
            self._unset(h, slot)

    # ---- queries ----
    def owners(self, h: bytes) -> int:
        """Bitmask of the slots holding block ``h``."""
        return self._owners.get(h, 0)

    def match(self, hashes: Sequence[bytes], slots_mask: int) -> dict[int, int]:
        """Leading run of ``hashes`` resident on each slot in ``slots_mask``.

        Returns ``{slot: blocks}`` for every slot in the mask (0 where nothing matches).
        """
        runs: dict[int, int] = {}
        alive = slots_mask
        get = self._owners.get
        for i, h in enumerate(hashes):
            m = get(h, 0)
            dead = alive & ~m
            if dead:
                _assign(runs, dead, i)
                alive &= m
                if not alive:
                    return runs
        _assign(runs, alive, len(hashes))
        return runs


def _assign(runs: dict[int, int], mask: int, value: int) -> None:
    while mask:
        low = mask & -mask
        runs[low.bit_length() - 1] = value
        mask ^= low
