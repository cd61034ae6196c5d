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
from tests.helpers.payload import payload, size_of
from tests.helpers.waiting import wait_until
from tests.store.store_contract import get, put

DEFAULT_HOT_S = StoreConfig.hot_timeout_s  # what engines run with (0.1 s)
HOT_BOUND_S = 0.3  # a hot call's bound at the default (plus one socket wake-up)
AT_ONCE_S = DEFAULT_HOT_S  # faster than a call to the stopped store could be: none was made


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
    cfg = store_cfg.with_(hot_timeout_s=DEFAULT_HOT_S, reconnect_interval_s=1.0, op_timeout_s=2.0)
    keys = [f"c/{i}" for i in range(8)]
    # closed whatever happens: a client left with its breaker open would restart the
    # coordinator in the background after the fixture stopped it
    with open_store(cfg) as store, open_store(cfg) as looker:  # looker: lookups only
        assert isinstance(store, LocalStore) and isinstance(looker, LocalStore)
        assert put(store, keys, [None, *keys[:-1]]) == [OK] * len(keys)
        held = store.batch_acquire(keys[:2])
        pid = store.stats()["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            # a second client's launcher finds the stopped coordinator: it starts nothing
            launcher.ensure_running(cfg)
            assert ownership.holder(cfg) == pid
            # the shared index answers without the coordinator while its heartbeat is fresh
            assert store.batch_exists(keys) == len(keys)
            # the first hot call that needs the coordinator gives up in time ...
            out, dt = timed(lambda: store.batch_acquire(keys))
            assert isinstance(out, StoreUnavailable) and dt < HOT_BOUND_S, (out, dt)
            assert not store.lease_valid(held)  # its connection is gone: the lease lapsed
            store.release(held)
            # ... and the open breaker answers every hot call at once
            for call, want in ((lambda: store.batch_exists(keys), 0),
                               (lambda: store.batch_residency(keys).run, 0),
                               (lambda: put(store, ["x"]), [ERR_UNAVAILABLE]),
                               (lambda: get(store, keys[:1]), [None])):
                out, dt = timed(call)
                assert out == want and dt < AT_ONCE_S, (out, dt)
            for call in (lambda: store.batch_alloc(["y"], [64]),
                         lambda: store.batch_acquire(keys)):
                out, dt = timed(call)
                assert isinstance(out, StoreUnavailable) and dt < AT_ONCE_S, (out, dt)
            # a stale heartbeat sends lookups to the socket: bounded the same way
            time.sleep(STALE_AFTER_MS / 1000 + 0.3)
            out, dt = timed(lambda: looker.batch_exists(keys))
            assert out == 0 and dt < HOT_BOUND_S, (out, dt)
            out, dt = timed(lambda: looker.batch_exists(keys))
            assert out == 0 and dt < AT_ONCE_S, (out, dt)
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
    with open_store(store_cfg.with_(hot_timeout_s=DEFAULT_HOT_S)) as store:
        assert isinstance(store, LocalStore)
        (slot,) = store.batch_alloc(["s"], [size_of("s")])
        assert slot is not None
        pid = store.stats()["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            data = payload("s", slot.size)
            ctypes.memmove(slot.ptr, data.ctypes.data, slot.size)  # the layer hook's pack
            out, dt = timed(lambda: store.batch_commit([slot]))
            assert out == [ERR_UNAVAILABLE] and dt < HOT_BOUND_S, (out, dt)
            out, dt = timed(lambda: store.batch_commit([slot]))  # committed once, not twice
            assert out == [ERR_UNAVAILABLE] and dt < AT_ONCE_S
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
    with open_store(store_cfg.with_(hot_timeout_s=timeout_s, shared_index=False)) as store:
        pid = store.stats()["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            out, dt = timed(lambda: store.batch_exists(["k"]))
            assert out == 0 and timeout_s * 0.9 <= dt < 2 * timeout_s + 0.1, dt
        finally:
            os.kill(pid, signal.SIGCONT)
