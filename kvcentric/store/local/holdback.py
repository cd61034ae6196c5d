"""Writers held back for the demoter: the coordinator's side of "wait briefly, or refuse".

A :class:`~kvcentric.store.local.tiered.TieredIndex` answers
:data:`~kvcentric.store.local.tiered.HOLD` for a key it cannot place yet without dropping an
object that has no disk copy (or while such objects fill ``dirty_limit`` of DRAM): the disk
is behind, not full. The coordinator then parks the rest of that ``reserve`` request here
instead of answering it, and its loop goes on serving every other client. Contract:

- **Bounded.** A parked request is answered at most ``wait_s`` after it arrived (plus one
  loop turn): until then :meth:`due` retries it after every loop turn (demotions completing,
  leases released and aborts all wake the loop; :meth:`timeout` bounds the loop's sleep);
  at the deadline it is finished with ``hold=False``, so each remaining key is placed
  (free space and clean copies only) or refused with ``ERR_NO_SPACE``.
- **Nothing waits here.** No call blocks or sleeps; a parked request costs one index
  probe per loop turn.
- **In order.** Parked requests are retried first come, first served, and a request that
  arrives while others are parked queues behind them, so a flood cannot starve an earlier
  writer. Per client, the coordinator answers later requests only after the parked one
  (replies stay in request order).
- **Per key, in order.** Keys placed before a ``HOLD`` keep their slots (PENDING, owned by
  the client: reclaimed with its connection, see :meth:`forget`); the rest wait together,
  so a chain's child is never placed before its parent in the same request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcentric.store.local.tiered import HOLD, TieredIndex

POLL_S = 0.005  # retry parked requests at least this often (pins and backoffs end on timers)


@dataclass
class _Parked:
    keys: list[str]
    sizes: list[int]
    parents: list[str | None]
    since: float
    deadline: float
    codes: list[int] = field(default_factory=list)  # one per key placed or refused so far


class Holdback:
    """Parked ``reserve`` requests of one coordinator, by client (``owner``)."""

    def __init__(self, index: TieredIndex, wait_s: float) -> None:
        self.index = index
        self.wait_s = wait_s
        self._parked: dict[int, _Parked] = {}  # insertion order = arrival order

    def reserve(self, owner: int, keys: list[str], sizes: list[int],
                parents: list[str | None], now: float) -> list[int] | None:
        """The request's codes, or None when it is parked (:meth:`due` answers it)."""
        p = _Parked(keys, sizes, parents, now, now + self.wait_s)
        if not self._parked and self._advance(owner, p, now):
            return p.codes
        self._parked[owner] = p
        self.index.tiers.put_waits += 1
        return None

    def holds(self, owner: int) -> bool:
        return owner in self._parked

    def due(self, now: float) -> list[tuple[int, list[int]]]:
        """Retry parked requests in arrival order; returns ``(owner, codes)`` of those now
        answered. Stops at the first that must still wait: every later one arrived later,
        so its deadline is no earlier."""
        done: list[tuple[int, list[int]]] = []
        for owner, p in list(self._parked.items()):
            if not self._advance(owner, p, now):
                break
            del self._parked[owner]
            self.index.tiers.put_wait_ms += round((now - p.since) * 1000)
            done.append((owner, p.codes))
        return done

    def forget(self, owner: int) -> None:
        """Drop a gone client's parked request (its placed keys are aborted with its
        connection)."""
        self._parked.pop(owner, None)

    def timeout(self, now: float) -> float | None:
        """How long the loop may sleep before :meth:`due` must run again (None: no limit)."""
        p = next(iter(self._parked.values()), None)
        return None if p is None else max(0.0, min(POLL_S, p.deadline - now))

    def _advance(self, owner: int, p: _Parked, now: float) -> bool:
        """Place ``p``'s remaining keys in order until one must wait; True when every key
        has its code."""
        hold = now < p.deadline
        while len(p.codes) < len(p.keys):
            i = len(p.codes)
            code = self.index.reserve(p.keys[i], p.sizes[i], p.parents[i], owner, hold=hold)
            if code == HOLD:
                return False
            p.codes.append(code)
        return True
