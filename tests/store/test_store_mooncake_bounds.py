"""Bounded Mooncake calls without Mooncake (issue 31, item 3): the call runner gives up on
a call that overruns its bound, abandons it safely (the memory it may still use is held
until it returns), cancels what never started, and the staging arena keeps held objects
out of every later slot or lease. The real faults (a SIGSTOPped master and storage node)
are in tests/store/test_store_mooncake_hung.py."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import StoreUnavailable
from kvcentric.store.mooncake import calls
from kvcentric.store.mooncake.calls import CallRunner, CallTimeout
from kvcentric.store.mooncake.staging import StagingArena
from tests.helpers.waiting import wait_until

SLACK_S = 0.25  # a thread wake-up on a loaded 2-core box


class Record:
    """What the runner told its owner: timeouts, holds and unholds."""

    def __init__(self) -> None:
        self.timeouts: list[str] = []
        self.held: list[tuple[int, ...]] = []
        self.unheld: list[tuple[int, ...]] = []

    def runner(self, **kw: int) -> CallRunner:
        return CallRunner("test", self.timeouts.append, lambda p: self.held.append(tuple(p)),
                          lambda p: self.unheld.append(tuple(p)), **kw)


@pytest.fixture
def rec() -> Iterator[Record]:
    yield Record()


def test_a_call_that_returns_in_time_passes_its_result_and_errors(rec: Record) -> None:
    r = rec.runner()
    assert r.run(lambda: 42, 1.0) == 42
    empty: dict[str, int] = {}
    with pytest.raises(KeyError):
        r.run(lambda: empty["x"], 1.0)
    assert rec.timeouts == [] and r.abandoned == 0 and r.outstanding == 0
    r.close()


def test_an_overrun_call_is_abandoned_with_its_memory_held_until_it_returns(rec: Record) -> None:
    r = rec.runner()
    hung, ran = threading.Event(), threading.Event()

    def stuck() -> str:
        ran.set()
        hung.wait(10)
        return "late"

    t0 = time.monotonic()
    with pytest.raises(CallTimeout) as err:
        r.run(stuck, 0.1, held=[1, 2], what="ranged get")
    assert 0.1 <= time.monotonic() - t0 < 0.1 + SLACK_S
    assert isinstance(err.value, StoreUnavailable) and "ranged get" in str(err.value)
    assert ran.is_set() and rec.timeouts and rec.held == [(1, 2)] and rec.unheld == []
    assert r.outstanding == 1 and r.abandoned == 1
    assert r.run(lambda: "next", 1.0) == "next"  # another thread serves meanwhile
    hung.set()
    assert wait_until(lambda: r.outstanding == 0, 5)
    assert rec.unheld == [(1, 2)] and r.abandoned == 1
    r.close()


def test_an_abandoned_call_yields_the_cpu_and_its_thread_retires(rec: Record) -> None:
    """A call blocked on a stopped node polls (Mooncake's TCP transfer): its thread must
    not compete with the forward pass, and, unable to climb back unprivileged, it ends
    once the call returns."""
    r = rec.runner(threads=1)
    hung, tids = threading.Event(), []

    def stuck() -> None:
        tids.append(threading.get_native_id())
        hung.wait(10)

    with pytest.raises(CallTimeout):
        r.run(stuck, 0.05)
    (tid,) = tids
    assert (os.sched_getscheduler(tid) == os.SCHED_IDLE
            or os.getpriority(os.PRIO_PROCESS, tid) == 19)
    fresh = r.run(threading.get_native_id, 1.0)  # served by a thread at full priority
    assert fresh != tid and os.sched_getscheduler(fresh) == os.SCHED_OTHER
    hung.set()
    assert wait_until(lambda: not os.path.exists(f"/proc/self/task/{tid}"), 5)
    assert r.run(lambda: "after", 1.0) == "after"
    r.close()


def test_a_call_that_never_started_is_cancelled_and_touches_nothing(
        rec: Record, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calls, "MAX_THREADS", 1)
    r = rec.runner(threads=1)
    hung, second = threading.Event(), threading.Event()
    with pytest.raises(CallTimeout):
        r.run(lambda: hung.wait(10), 0.05)
    with pytest.raises(CallTimeout):  # queued behind the stuck one: given up, cancelled
        r.run(second.set, 0.05, held=[7])
    assert rec.held == [()] or rec.held == []  # only the started call may hold anything
    assert r.outstanding == 1
    hung.set()
    assert wait_until(lambda: r.outstanding == 0, 5)
    # a call submitted now runs after anything still queued: once it has run, the
    # cancelled one would have too
    assert r.run(lambda: "later", 5.0) == "later"
    assert not second.is_set()  # the cancelled call never ran
    r.close()


def test_stuck_threads_are_replaced_up_to_the_cap(rec: Record) -> None:
    r = rec.runner(threads=1)
    hung = threading.Event()
    for _ in range(3):
        with pytest.raises(CallTimeout):
            r.run(lambda: hung.wait(10), 0.05)
    assert r.run(lambda: "served", 1.0) == "served"
    assert r.outstanding == 3
    hung.set()
    assert wait_until(lambda: r.outstanding == 0, 5)
    r.close()
    with pytest.raises(StoreUnavailable):
        r.run(lambda: None, 1.0)


def _registered(ptr: int, size: int) -> int:
    return 0


def test_held_staging_is_never_handed_out_again_until_unheld() -> None:
    arena = StagingArena(1 << 20, _registered)
    try:
        (a,) = arena.alloc_run([512 << 10])
        (b,) = arena.alloc_run([512 << 10])
        assert arena.alloc_run([64]) == []  # full
        arena.hold([a])
        arena.free([a])  # its lease ended, but an abandoned get may still write into it
        assert arena.alloc_run([64]) == [] and arena.held == 1
        assert arena.held_bytes == 512 << 10
        arena.unhold([a])  # the call returned
        assert arena.held == 0 and arena.alloc_run([512 << 10]) == [a]
        arena.hold([b])
        arena.unhold([b])  # a call that returned before its owner freed: nothing deferred
        arena.free([b])
        assert arena.used == 512 << 10
        arena.hold([a])
        arena.hold([a])  # two abandoned calls on one object: free after both return
        arena.free([a])
        arena.unhold([a])
        assert arena.used == 512 << 10
        arena.unhold([a])
        assert arena.used == 0
    finally:
        arena.close()


def test_objects_sharing_an_extent_return_when_the_held_one_does() -> None:
    arena = StagingArena(1 << 20, _registered)
    try:
        ptrs = arena.alloc_run([256 << 10] * 4)  # one extent
        arena.hold(ptrs[1:2])
        arena.free(ptrs)
        assert arena.used == 1 << 20  # the extent stays while one of its objects is held
        arena.unhold(ptrs[1:2])
        assert arena.used == 0
    finally:
        arena.close()


@pytest.mark.parametrize(("raw", "rate"), [({}, 256 << 20),
                                           ({"min_transfer_rate": "1gb"}, 1 << 30),
                                           ({"min_transfer_rate": 1000}, 1000)])
def test_min_transfer_rate_is_a_size_per_second(raw: dict[str, object], rate: int) -> None:
    cfg = StoreConfig.from_dict({"backend": "mooncake", **raw})
    assert cfg.min_transfer_rate == rate and cfg.hot_timeout_s == 0.1


@pytest.mark.parametrize("bad", [0, -5, "0mb"])
def test_min_transfer_rate_must_be_positive(bad: object) -> None:
    with pytest.raises(ValueError, match="min_transfer_rate|size"):
        StoreConfig.from_dict({"min_transfer_rate": bad})
