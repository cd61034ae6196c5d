"""What instances compute on, as the cost model sees it: queued prefill work and speed.

Instances naming the same ``compute`` (several engines on one GPU, vLLM CPU engines bound
to the same cores) share one :class:`Processor`. Per member it holds the prefills
dispatched there and not yet seen finishing (predicted seconds of work left each, as if
alone on the processor), and one correction of the profile's prefill times measured on
it. How members share it (``cost.shared_compute``):

* ``serial``: one FIFO over the processor: a prefill waits for all work dispatched
  before it, whichever member it went to. Engines time-sliced on one device (a GPU
  without MPS, CPU engines whose spinning OpenMP workers share cores) behave so, or
  worse (spinning workers steal each other's time slices, so turns run slower than a
  fair split predicts).
* ``fair``: egalitarian processor sharing: each member runs its own prefills one after
  another and the members with work split the processor equally, so a prefill on an idle
  member is slowed by its busy peers but does not wait behind them (engines sharing a
  GPU through MPS).

A prefill not reported done leaves when its predicted work is done. Everything here runs
on the router's event loop.
"""

from __future__ import annotations

from collections import OrderedDict

SHARING = ("serial", "fair")
OUTLIER = 2.0  # observed / current correction beyond which one prefill is not evidence


class Processor:
    def __init__(self, sharing: str = "serial") -> None:
        if sharing not in SHARING:
            raise ValueError(f"shared_compute must be one of {SHARING}, got {sharing!r}")
        self.sharing = sharing
        self.members = 0  # instances computing here (the registry counts them)
        self._queues: dict[str, OrderedDict[str, float]] = {}
        self._order: OrderedDict[str, str] = OrderedDict()  # rid -> member, dispatch order
        self._t: float | None = None  # when the work left was last advanced
        self.correction = 1.0  # EWMA of actual / predicted prefill time
        self._outlier = 0  # the last observation was an outlier: 1 slower, -1 faster

    @property
    def shared(self) -> bool:
        return self.members > 1

    def pending(self, member: str) -> int:
        return len(self._queues.get(member, ()))

    def idle(self, now: float) -> bool:
        """No member has prefill work left: new work here slows nobody's."""
        self._advance(now)
        return not self._order

    def _advance(self, now: float) -> None:
        """Serve the work left up to ``now``."""
        dt = 0.0 if self._t is None else now - self._t
        self._t = now if self._t is None else max(self._t, now)
        if self.sharing == "serial":
            self._advance_serial(dt)
        else:
            self._advance_fair(dt)

    def _advance_serial(self, dt: float) -> None:
        while dt > 0 and self._order:
            rid, member = next(iter(self._order.items()))
            q = self._queues[member]
            step = min(q[rid], dt)
            q[rid] -= step
            dt -= step
            if q[rid] <= 1e-9:
                self._remove(rid, member)

    def _advance_fair(self, dt: float) -> None:
        while dt > 0:
            busy = [(m, q) for m, q in self._queues.items() if q]
            if not busy:
                return
            step = min(next(iter(q.values())) for _, q in busy)  # the first head to finish
            if step * len(busy) > dt:
                step = dt / len(busy)
            dt -= step * len(busy)
            for m, q in busy:
                head = next(iter(q))
                q[head] -= step
                if q[head] <= 1e-9:
                    self._remove(head, m)

    def _remove(self, rid: str, member: str) -> None:
        self._queues[member].pop(rid, None)
        self._order.pop(rid, None)

    def queue_s(self, member: str, now: float, work_s: float = 0.0) -> float:
        """Predicted seconds ``member`` spends before ``work_s`` more seconds of its own
        prefill are done, beyond ``work_s`` itself. Serial: all work queued on the
        processor. Fair: its own backlog ``W`` plus, from each peer with backlog ``W_j``,
        ``min(W_j, W + work_s)`` (the share the peer takes while both run)."""
        self._advance(now)
        if self.sharing == "serial":
            return sum(sum(q.values()) for q in self._queues.values())
        own = sum(self._queues.get(member, {}).values())
        mine = own + work_s
        return own + sum(min(sum(q.values()), mine)
                         for m, q in self._queues.items() if m != member and q)

    def add(self, member: str, rid: str, pred_s: float, now: float) -> None:
        self._advance(now)
        self._queues.setdefault(member, OrderedDict())[rid] = pred_s
        self._order[rid] = member

    def done(self, rid: str, now: float) -> None:
        self._advance(now)
        member = self._order.get(rid)
        if member is not None:
            self._remove(rid, member)

    def drop(self, member: str) -> None:
        """``member`` left: its queued work is no longer the processor's."""
        for rid in list(self._queues.pop(member, {})):
            self._order.pop(rid, None)
        self.members = max(0, self.members - 1)

    def observe(self, predicted_s: float, actual_s: float, weight: float = 0.2) -> None:
        """Fold an observed prefill time into the correction factor (bounded 0.25..4).

        An observation more than :data:`OUTLIER` times off the current correction is
        folded in only when the one before it was off the same way: a lone one is far
        more likely a mispredicted hit (residency the engine no longer has, a block
        evicted meanwhile: the prefill computed what the model thought cached) than a
        processor that changed speed, and learning it would keep requests away from a
        healthy instance for dozens of prefills. A sustained change (a processor now
        shared) is learned from its second observation on."""
        if predicted_s <= 0 or actual_s <= 0:
            return
        ratio = min(4.0, max(0.25, actual_s / predicted_s))
        off = ratio / self.correction
        side = 1 if off > OUTLIER else -1 if off < 1 / OUTLIER else 0
        held, self._outlier = self._outlier, side
        if side and held != side:
            return
        self.correction = min(4.0, max(0.25, (1 - weight) * self.correction + weight * ratio))
