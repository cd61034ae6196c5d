"""A hung local store never holds a forward pass (issue 31, item 3), with the fault
mounted for real: the coordinator is SIGSTOPped. Hot-path calls (reserve, acquire,
commit, lookups) give up within the hot timeout, the circuit breaker then answers at once
without asking the store, nobody starts a second coordinator, and after SIGCONT the
background reconnect brings the hits back."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import ERR_UNAVAILABLE, OK, StoreUnavailable, open_store
from kvcentric.store.local import launcher, ownership
from kvcentric.store.local.client import LocalStore
from kvcentric.store.local.shared_index import STALE_AFTER_MS
from kvcentric.testing.signals import sigstop
from tests.helpers.payload import payload, size_of
from tests.helpers.waiting import wait_until
from tests.store.store_contract import get, put

# serial (tests/helpers/xdist_groups.py): its bounds are tenths of a second
pytestmark = pytest.mark.serial

DEFAULT_HOT_S = StoreConfig.hot_timeout_s  # what engines run with (0.1 s)
# The stopped coordinator never answers, so a call ends on one of two bounds: the hot
# bound it must use, or the op bound (OP_S) it would fall back to. A call that ends
# before half of the op bound used the hot one: a margin of about a second over it, which
# a pause of this process (over 100 ms on a loaded 2-core box) does not break.
OP_S = 2.5
HOT_BOUND_S = OP_S / 2
ROUNDS = 10  # at_once's calls per kind: their total time is what is bounded


def at_once(calls: list[tuple[Callable[[], Any], Any]]) -> None:
    """Each call, ``ROUNDS`` times, gives its answer (an exception type: raises it) from
    the open breaker: faster in total than half of what as many calls to the stopped
    coordinator would wait (each at least the hot bound), so no call was made."""
    total = 0.0
    for _ in range(ROUNDS):
        for call, want in calls:
            out, dt = timed(call)
            if isinstance(want, type):
                assert isinstance(out, want), out
            else:
                assert out == want, out
            total += dt
    assert total < ROUNDS * len(calls) * DEFAULT_HOT_S / 2, total


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    try:
        out = fn()
    except StoreUnavailable as exc:
        out = exc
    return out, time.monotonic() - t0


def answered(store: LocalStore, stat: str) -> Any:
    """A stat once the store answers again (None while the breaker is open)."""
    try:
        return store.stats()[stat]
    except StoreUnavailable:
        return None


def test_sigstop_bounds_hot_calls_then_the_breaker_answers(store_cfg: StoreConfig) -> None:
    cfg = store_cfg.with_(hot_timeout_s=DEFAULT_HOT_S, reconnect_interval_s=1.0,
                          op_timeout_s=OP_S)
    keys = [f"c/{i}" for i in range(8)]
    # closed whatever happens: a client left with its breaker open would restart the
    # coordinator in the background after the fixture stopped it
    with open_store(cfg) as store, open_store(cfg) as looker:  # looker: lookups only
        assert isinstance(store, LocalStore) and isinstance(looker, LocalStore)
        assert put(store, keys, [None, *keys[:-1]]) == [OK] * len(keys)
        held = store.batch_acquire(keys[:2])
        pid = store.stats()["pid"]
        sigstop(pid)
        try:
            # a second client's launcher finds the stopped coordinator: it starts nothing
            launcher.ensure_running(cfg)
            assert ownership.holder(cfg) == pid
            # the shared index answers without the coordinator while its heartbeat is fresh
            assert store.batch_exists(keys) == len(keys)
            # the first hot call that needs the coordinator gives up in time ...
            out, dt = timed(lambda: store.batch_acquire(keys))
            assert isinstance(out, StoreUnavailable), out
            assert DEFAULT_HOT_S * 0.9 <= dt < HOT_BOUND_S, dt
            assert not store.lease_valid(held)  # its connection is gone: the lease lapsed
            store.release(held)
            # ... and the open breaker answers every hot call at once
            at_once([(lambda: store.batch_exists(keys), 0),
                     (lambda: store.batch_residency(keys).run, 0),
                     (lambda: put(store, ["x"]), [ERR_UNAVAILABLE]),
                     (lambda: get(store, keys[:1]), [None]),
                     (lambda: store.batch_alloc(["y"], [64]), StoreUnavailable),
                     (lambda: store.batch_acquire(keys), StoreUnavailable)])
            # a stale heartbeat sends lookups to the socket: bounded the same way. Wait for
            # the staleness itself (the shared index declines to answer), not a guess of it
            index = looker._link.session.index if looker._link.session else None
            assert index is not None
            assert wait_until(lambda: index.leading_run(keys) is None,
                              STALE_AFTER_MS / 1000 + 10)
            out, dt = timed(lambda: looker.batch_exists(keys))
            assert out == 0 and DEFAULT_HOT_S * 0.9 <= dt < HOT_BOUND_S, (out, dt)
            at_once([(lambda: looker.batch_exists(keys), 0)])
        finally:
            os.kill(pid, signal.SIGCONT)
        # the background reconnect finds the same coordinator: hits return
        assert wait_until(lambda: store.batch_exists(keys) == len(keys), 10)
        assert wait_until(lambda: looker.batch_exists(keys) == len(keys), 10)
        for k, b in zip(keys, get(store, keys)):
            assert b is not None and np.array_equal(b, payload(k, size_of(k)))
        assert put(store, ["after"]) == [OK]
        assert store.stats()["pid"] == pid and store.stats()["leases"] == 0


def test_a_slot_reserved_before_a_stop_commits_as_unavailable(store_cfg: StoreConfig) -> None:
    """The save path: a slot reserved before the stop, committed during it, fails within
    the hot bound; the slot's memory stays mapped until then (the copy into it is safe)."""
    with open_store(store_cfg.with_(hot_timeout_s=DEFAULT_HOT_S, op_timeout_s=OP_S)) as store:
        assert isinstance(store, LocalStore)
        (slot,) = store.batch_alloc(["s"], [size_of("s")])
        assert slot is not None
        pid = store.stats()["pid"]
        sigstop(pid)
        try:
            data = payload("s", slot.size)
            ctypes.memmove(slot.ptr, data.ctypes.data, slot.size)  # the layer hook's pack
            out, dt = timed(lambda: store.batch_commit([slot]))
            assert out == [ERR_UNAVAILABLE] and dt < HOT_BOUND_S, (out, dt)
            # committed once, not twice: the breaker answers the second
            at_once([(lambda: store.batch_commit([slot]), [ERR_UNAVAILABLE])])
        finally:
            os.kill(pid, signal.SIGCONT)
        # the coordinator reclaimed the slot with the dropped connection, or (it read the
        # commit before it saw the connection close) published it: its bytes were whole
        # before the commit was sent, so either way nothing torn is visible
        assert wait_until(lambda: answered(store, "pending") == 0, 10)
        (b,) = get(store, ["s"])
        assert b is None or np.array_equal(b, payload("s", slot.size))


@pytest.mark.parametrize("timeout_s", [0.05, 0.3])
def test_hot_timeout_is_configurable(store_cfg: StoreConfig, timeout_s: float) -> None:
    """The configured hot bound ends the call: not before it (a pause only lengthens a
    call), and well before the op bound it would otherwise wait (10 s here, so the
    margin, seconds, survives a paused process)."""
    with open_store(store_cfg.with_(hot_timeout_s=timeout_s, shared_index=False,
                                    op_timeout_s=10.0)) as store:
        pid = store.stats()["pid"]
        sigstop(pid)
        try:
            out, dt = timed(lambda: store.batch_exists(["k"]))
            assert out == 0 and timeout_s * 0.9 <= dt < timeout_s + 2.0, dt
        finally:
            os.kill(pid, signal.SIGCONT)
