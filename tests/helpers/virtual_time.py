"""Virtual time for asyncio code under test: timers fire in order, at once, and the clock
jumps to each; no wall clock is read, so a paused or descheduled test process cannot
move a measured duration.

:func:`run` runs a coroutine on a :class:`VirtualLoop` whose ``time()`` is a
:class:`VirtualClock`; code that reads ``time.monotonic()`` itself (the emulator's
processors) is given the same clock (``clock.module``, in place of its ``time``). When
nothing is ready the loop's selector, instead of sleeping until the next timer, advances
the clock to it. Real I/O still works (it is polled without waiting); with no timer and
nothing ready the selector blocks as usual.
"""

from __future__ import annotations

import asyncio
import selectors
import types
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualClock:
    """Seconds since the loop started, advanced only by the loop's waits."""

    def __init__(self) -> None:
        self.now = 0.0
        # stands in for a module's ``time``: monotonic and perf_counter read this clock
        self.module = types.SimpleNamespace(monotonic=self.read, perf_counter=self.read)

    def read(self) -> float:
        return self.now


class _Selector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = super().select(0)
        if ready or timeout is None:
            return ready if ready or timeout is not None else super().select(None)
        if timeout > 0:
            self._clock.now += timeout
        return ready


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock is ``clock`` (see the module's docstring)."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(_Selector(clock))
        self.clock = clock

    def time(self) -> float:
        return self.clock.now


def run(aw: Awaitable[T], clock: VirtualClock) -> T:
    """``aw`` run to completion on a fresh :class:`VirtualLoop` of ``clock``."""
    with asyncio.Runner(loop_factory=lambda: VirtualLoop(clock)) as runner:
        return runner.run(aw)  # type: ignore[arg-type]
