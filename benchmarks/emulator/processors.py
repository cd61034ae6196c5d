"""What emulated engines compute on: each its own processor, or several sharing one.

An engine's step is ``work_s`` seconds of its processor alone (:mod:`.profile`).
:meth:`run` returns once the step is done, by one of two disciplines:

* :class:`Processor` (``fair``): processor sharing, each of ``k`` engines with a step
  under way progressing at ``1 / k`` of full speed (times ``slowdown`` when ``k > 1``):
  engines sharing a GPU through MPS, say. With one engine it is just the step's time.
  In general each progresses at ``1 / (1 + x * (k - 1))`` of full speed, ``x`` the
  ``interference`` (1: one processor shared; otherwise engines on cores of their own
  that slow each other through what their host shares, its other processes above all:
  ``EngineProfile.host_interference``, measured by ``measure --pair``), or ``x`` drawn
  per step from measured ``samples``.
* :class:`ExclusiveProcessor` (``exclusive``): one engine at a time. The engine holding
  the processor runs its steps back to back; another engine's step waits until the
  holder has had no step for ``handoff_s`` (its threads keep the processor that long
  after its last step), then that engine holds it. Measured on two vLLM CPU engines
  whose workers share this machine's core (``benchmarks.emulator.measure --shared``):
  a prefill arriving while the other engine decodes starts only once that decode is
  over, ~1.0 s later again (0.93-1.05 s over 7 trials), and the decode's inter-token
  latency does not move; two prefills arriving together run one after the other, the
  second ~1.0 s after the first ends.

Time is :func:`time.monotonic` (uvloop's ``loop.time()`` has millisecond steps and its
timers may fire up to a millisecond early): a step within :data:`TOLERANCE_S` of done
when its timer fires is done, so nothing spins on sub-millisecond remainders.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Hashable, Sequence

TOLERANCE_S = 1e-3
DISCIPLINES = ("fair", "exclusive")


class Processor:
    """Processor sharing among the engines with a step under way. A step's ``x`` (how
    much each other engine in a step slows it) is ``interference``, or drawn for each
    step from ``samples`` with a ``seed``-ed generator: the spread measured on a host,
    where most overlapped steps run as fast as alone and a few stall for several times
    their length."""

    def __init__(self, slowdown: float = 1.0, interference: float = 1.0,
                 samples: Sequence[float] = (), seed: int = 0) -> None:
        if not slowdown >= 1.0:
            raise ValueError("slowdown must be >= 1")
        if not all(0.0 <= x < float("inf") for x in (interference, *samples)):
            raise ValueError("interference must be >= 0")
        self.slowdown = slowdown
        self.interference = interference
        self.samples = tuple(samples)
        self._rnd = random.Random(seed)
        self._jobs: dict[asyncio.Future[None], list[float]] = {}  # [work left alone, x]
        self._t = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def _rate(self, x: float) -> float:
        k = len(self._jobs)
        return 1.0 if k <= 1 else 1.0 / ((1 + x * (k - 1)) * self.slowdown)

    def _advance(self, now: float) -> None:
        dt = now - self._t
        for job in self._jobs.values():
            job[0] -= dt * self._rate(job[1])
        self._t = now

    def _schedule(self, loop: asyncio.AbstractEventLoop, tolerance_s: float = 1e-9) -> None:
        """Finish every job within ``tolerance_s`` (wall) of done; time the next."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        walls = {f: left / self._rate(x) for f, (left, x) in self._jobs.items()}
        for f, wall in walls.items():
            if wall <= tolerance_s:
                del self._jobs[f]
                if not f.done():
                    f.set_result(None)
        if self._jobs:  # rates depend on how many are left: recompute
            soonest = min(left / self._rate(x) for left, x in self._jobs.values())
            self._timer = loop.call_later(max(0.0, self._t + soonest - time.monotonic()),
                                          self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._advance(time.monotonic())
        self._schedule(loop, TOLERANCE_S)

    async def run(self, work_s: float, key: Hashable = None) -> None:
        """Return once ``work_s`` seconds of work (alone on the processor) are done."""
        if work_s <= 0:
            return
        loop = asyncio.get_running_loop()
        self._advance(time.monotonic())
        fut: asyncio.Future[None] = loop.create_future()
        x = self._rnd.choice(self.samples) if self.samples else self.interference
        self._jobs[fut] = [work_s, x]
        self._schedule(loop)
        try:
            await fut
        finally:
            if self._jobs.pop(fut, None) is not None:  # cancelled: its share goes back
                self._advance(time.monotonic())
                self._schedule(loop)


class ExclusiveProcessor:
    """One engine's steps at a time; the holder keeps the processor ``handoff_s`` past
    its last step (see the module docstring)."""

    def __init__(self, handoff_s: float = 0.0) -> None:
        if not handoff_s >= 0:
            raise ValueError("handoff_s must be >= 0")
        self.handoff_s = handoff_s
        self.holder: Hashable = None
        self._busy = False
        self._free_at = 0.0  # when an engine other than the holder may start
        self._queue: deque[tuple[Hashable, float, asyncio.Future[None]]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self.handoffs = 0

    async def run(self, work_s: float, key: Hashable = None) -> None:
        """Return once ``key``'s step of ``work_s`` seconds has had the processor."""
        if work_s <= 0:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._queue.append((key, work_s, fut))
        self._dispatch(loop)
        try:
            await fut
        finally:
            if not fut.done():  # cancelled while waiting
                self._queue = deque(j for j in self._queue if j[2] is not fut)

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._busy or not self._queue:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        now = time.monotonic()
        mine = next((j for j in self._queue if j[0] == self.holder), None)
        job = mine or self._queue[0]
        if job is not mine and now < self._free_at:  # the holder's threads still have it
            self._timer = loop.call_later(self._free_at - now, self._dispatch, loop)
            return
        self._queue.remove(job)
        key, work, fut = job
        if key != self.holder:
            self.handoffs += 1
        self.holder = key
        self._busy = True
        loop.call_later(work, self._done, loop, fut)

    def _done(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
        self._busy = False
        self._free_at = time.monotonic() + self.handoff_s
        if not fut.done():
            fut.set_result(None)
        # the holder's next step arrives a loop turn later: decide then (or at free_at)
        loop.call_soon(self._dispatch, loop)


def processors(n: int, compute: str, slowdown: float = 1.0, discipline: str = "fair",
               handoff_s: float = 0.0, interference: float = 1.0,
               samples: Sequence[float] = (), seed: int = 0
               ) -> list[Processor | ExclusiveProcessor]:
    """Per engine, its processor: ``separate`` (one each), ``shared`` (one for all) or
    ``K`` (groups of K consecutive engines), shared by ``discipline`` (``fair``: with
    ``interference`` or its ``samples``, see :class:`Processor`; group ``i`` draws with
    ``seed + i``)."""
    if discipline not in DISCIPLINES:
        raise ValueError(f"discipline must be one of {DISCIPLINES}")
    if compute == "separate":
        per = 1
    elif compute == "shared":
        per = n
    else:
        per = int(compute)
        if per < 1:
            raise ValueError("--compute K needs K >= 1")

    def make(i: int) -> Processor | ExclusiveProcessor:
        return (ExclusiveProcessor(handoff_s) if discipline == "exclusive"
                else Processor(slowdown, interference, samples, seed + i))

    procs = [make(i) for i in range(-(-n // per))]
    return [procs[i // per] for i in range(n)]
