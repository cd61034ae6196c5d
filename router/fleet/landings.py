"""Prefixes on their way into the store: blocks an in-flight prefill computes and saves.

A prompt's blocks reach the store when the prefill that computes them ends (the
connector saves them before the first token leaves the engine). Until then the store
does not hold them, so every request that shares a new prefix and arrives during its
first prefill either queues behind that prefill on its holder or computes the prefix
again elsewhere. With this table the router sees a third option: send such a request to
an instance that waits for the prefill to land and then loads the prefix from the store
(:class:`kvcentric.router.cost.decision.Landing`; the proxy holds the request until then).

Per dispatched request the router records the block hashes its prefill computes (those
beyond what its instance holds or loads) under the request's id, with the time its
prefill is predicted to end; a block already recorded by an earlier request stays
that request's. The record ends when the prefill ends (:meth:`Landings.land`: its blocks
are then in the store) or the request leaves without one, which wakes whoever waits on it.

Memory: at most ``max_blocks`` hashes are recorded; a request that would exceed it is not
recorded (its followers compute or queue as without the table). Runs on the router's
event loop only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvcentric.router.cost.decision import Landing

MAX_BLOCKS = 1 << 20  # hashes recorded at once (32 bytes each, plus the dict's own)
K = TypeVar("K", bound=Hashable)  # a block's name: its hash (the simulator: its id)


@dataclass
class _InFlight(Generic[K]):
    hashes: list[K]
    ready_at: float
    landed: asyncio.Event = field(default_factory=asyncio.Event)


class Landings(Generic[K]):
    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        self._owner: dict[K, str] = {}  # block -> the request computing it
        self._inflight: dict[str, _InFlight[K]] = {}

    def __len__(self) -> int:
        """Blocks recorded."""
        return len(self._owner)

    def track(self, rid: str, hashes: Sequence[K], ready_at: float) -> None:
        """Request ``rid``'s prefill computes ``hashes`` (consecutive blocks of its prompt;
        possibly none known yet) and is predicted to end at ``ready_at``; those no earlier
        request computes are recorded as its. A second call for ``rid`` changes nothing."""
        if rid in self._inflight:
            return
        self._inflight[rid] = _InFlight[K]([], ready_at)
        self.extend(rid, hashes)

    def extend(self, rid: str, hashes: Sequence[K]) -> None:
        """More blocks ``rid``'s prefill computes (a scanned prompt's rest, hashed after
        its dispatch: :meth:`kvcentric.router.conductor.Conductor.resident_beyond_scan`);
        nothing when ``rid`` is not tracked (landed, or never recorded) or the table is
        full."""
        rec = self._inflight.get(rid)
        if rec is None:
            return
        mine = [h for h in hashes if h not in self._owner]
        if len(self._owner) + len(mine) > self.max_blocks:
            return
        for h in mine:
            self._owner[h] = rid
        rec.hashes.extend(mine)

    def tracked(self, rid: str) -> bool:
        """Whether ``rid``'s prefill is recorded and has not landed."""
        return rid in self._inflight

    def find(self, hashes: Sequence[K], start: int) -> Landing | None:
        """The landing that extends the store's leading run ``start`` of ``hashes``: the
        blocks from ``start`` on that in-flight prefills compute, up to the first that
        none does, and when the last of those prefills is predicted to end. None when
        no in-flight prefill computes ``hashes[start]``."""
        owner = self._owner
        keys: dict[str, None] = {}
        run = start
        for h in hashes[start:]:
            rid = owner.get(h)
            if rid is None:
                break
            keys[rid] = None
            run += 1
        if run == start:
            return None
        ready = max(self._inflight[k].ready_at for k in keys)
        return Landing(run, ready, tuple(keys))

    def land(self, rid: str) -> list[K]:
        """``rid``'s prefill ended or the request left: its record ends and whoever waits
        on it is woken. Returns the hashes it computed (empty when none were recorded)."""
        rec = self._inflight.pop(rid, None)
        if rec is None:
            return []
        owner = self._owner
        for h in rec.hashes:
            if owner.get(h) == rid:
                del owner[h]
        rec.landed.set()
        return rec.hashes

    async def wait(self, keys: Iterable[str], timeout_s: float) -> bool:
        """Wait until every request of ``keys`` has landed (or left), at most ``timeout_s``
        seconds; whether they all did."""
        events = [rec.landed for k in keys if (rec := self._inflight.get(k)) is not None]
        if not events:
            return True
        waiters = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            _, pending = await asyncio.wait(waiters, timeout=max(0.0, timeout_s))
        finally:
            for w in waiters:
                w.cancel()
        return not pending
