"""A hung Mooncake peer never holds a forward pass (issue 31, item 3), with the fault
mounted for real: the master, or the storage node holding the objects, is SIGSTOPped (its
ports still accept: nothing fails, Mooncake's calls just block). Every hot call --
lookups, ``batch_alloc``, ``batch_commit``, eager and streamed acquires, ranged gets --
returns within its bound (``hot_timeout_s``, plus the bytes at ``min_transfer_rate`` for
data); an abandoned call holds its staging until Mooncake returns it, so no later slot or
lease shares those bytes; the breaker then answers at once; after SIGCONT the hits come
back with the right bytes. The engines' side: tests/e2e/test_faults.py."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from kvcentric.store import ERR_UNAVAILABLE, OK, StoreUnavailable, open_store
from kvcentric.store.mooncake.store import MooncakeStore
from kvcentric.testing.netns import unavailable_reason
from kvcentric.testing.signals import sigstop_group
from tests.helpers.mooncake_cluster import MooncakeCluster, module_cluster_fixtures
from tests.helpers.payload import payload, size_of
from tests.helpers.waiting import wait_until
from tests.store.store_contract import get, put

pytest.importorskip("mooncake.store", reason="the Mooncake wheel is not installed")
_NO_NETNS = unavailable_reason()
pytestmark = [pytest.mark.mooncake, pytest.mark.serial,
              pytest.mark.skipif(_NO_NETNS is not None, reason=f"no netns: {_NO_NETNS}")]
HOT_S = 0.1  # the default hot_timeout_s: what engines run with
SLACK_S = 0.25  # a thread wake-up on a loaded 2-core box
ROUNDS = 10  # fail_fast's calls per kind: their total time is what is bounded


mc, _in_netns = module_cluster_fixtures("mooncake-hung")


def config(mc: MooncakeCluster, **over: Any) -> dict[str, Any]:
    """A pure client (its objects live on the cluster's storage nodes) at the default hot
    bound."""
    cfg = mc.store_config(**over)
    return cfg | {"hot_timeout_s": HOT_S}


@contextmanager
def stopped(proc: subprocess.Popen[Any] | None) -> Iterator[None]:
    """SIGSTOP ``proc``'s process group for the block; SIGCONT whatever happens."""
    assert proc is not None
    sigstop_group(proc.pid)  # returns once every thread is stopped, not when queued
    try:
        yield
    finally:
        os.killpg(proc.pid, signal.SIGCONT)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    try:
        out = fn()
    except StoreUnavailable as exc:
        out = exc
    return out, time.monotonic() - t0


def fail_fast(s: MooncakeStore, keys: list[str]) -> None:
    """Every hot call answers at once while the breaker is open: it makes no call (none
    is abandoned; a call to the stopped peer would be, after at least ``HOT_S``), and
    ``ROUNDS`` of each kind take less than half of what that many calls would have
    waited, a margin a pause of the test process well over a second does not break."""
    abandoned = s.ops.abandoned
    answering: list[tuple[Callable[[], Any], Any]] = [
        (lambda: s.batch_exists(keys), 0), (lambda: put(s, ["during"]), [ERR_UNAVAILABLE])]
    raising: list[Callable[[], Any]] = [
        lambda: s.batch_alloc(["during"], [64]),
        lambda: s.batch_acquire(keys, [size_of(k) for k in keys]),
        lambda: s.batch_acquire_streamed(keys, [size_of(k) for k in keys])]
    total = 0.0
    for _ in range(ROUNDS):
        for call, want in answering:
            out, dt = timed(call)
            assert out == want, out
            total += dt
        for call in raising:
            out, dt = timed(call)
            assert isinstance(out, StoreUnavailable), out
            total += dt
    calls = ROUNDS * (len(answering) + len(raising))
    assert s.ops.abandoned == abandoned, "a call was made with the breaker open"
    assert total < calls * HOT_S / 2, (total, calls)


def right_bytes(s: MooncakeStore, keys: list[str]) -> bool:
    got = get(s, keys)
    return all(b is not None and np.array_equal(b, payload(k, size_of(k)))
               for k, b in zip(keys, got))


def test_a_stopped_master_bounds_every_call_then_the_breaker_answers(
        mc: MooncakeCluster) -> None:
    mc.start_node("m-node", "64mb")
    keys = [f"m/{i}" for i in range(8)]
    try:
        with open_store(config(mc)) as s:
            assert isinstance(s, MooncakeStore)
            assert put(s, keys) == [OK] * len(keys)
            (slot,) = s.batch_alloc(["m/slot"], [4096])
            assert slot is not None
            with stopped(mc.master):
                out, dt = timed(lambda: s.batch_exists(keys))  # a lookup: the hot bound
                assert out == 0 and dt < HOT_S + SLACK_S, (out, dt)
                assert s.ops.outstanding == 1 and not s.health_check()
                fail_fast(s, keys)
                abandoned = s.ops.abandoned
                out, dt = timed(lambda: s.batch_commit([slot]))
                assert out == [ERR_UNAVAILABLE] and dt < HOT_S + SLACK_S, (out, dt)
                assert s.ops.abandoned == abandoned  # answered by the breaker: no call
                # the monitor keeps the breaker open while the call has not returned: its
                # own steps, run here, find the master still down (no wait for them)
                assert s.ops.monitor.check_once() is False
                assert s.ops.monitor.check_once() is False
                assert not s.health_check() and s.ops.outstanding == 1
            # SIGCONT: the abandoned lookup returns, a probe succeeds, hits return
            assert wait_until(lambda: s.batch_exists(keys) == len(keys), 20)
            assert right_bytes(s, keys)
            st = s.stats()
            assert st["abandoned_calls"] == 1 and st["abandoned_running"] == 0, st
            assert st["staging_used_bytes"] == 0 and st["staging_held_bytes"] == 0, st
            assert put(s, ["m/after"]) == [OK]
    finally:
        mc.kill_node("m-node", signal.SIGTERM)


@pytest.mark.parametrize("checksums", [False, True])
def test_a_stopped_node_bounds_loads_and_holds_their_staging(mc: MooncakeCluster,
                                                             checksums: bool) -> None:
    """Without checksums a lease is streamed (ranged gets per layer group); with them it
    is read whole when made. Either way the get that hangs on the stopped node gives up
    within its bytes' bound, and its staging stays out of use until it returns."""
    node = mc.start_node("s-node", "64mb")
    keys = [f"s{int(checksums)}/{i}" for i in range(8)]
    sizes = [size_of(k) for k in keys]
    try:
        with open_store(config(mc) | {"verify_checksums": checksums}) as s:
            assert isinstance(s, MooncakeStore)
            assert put(s, keys) == [OK] * len(keys)
            bound = s.bound_s(sum(sizes))
            streamed = None if checksums else s.batch_acquire_streamed(keys, sizes)
            used = s.stats()["staging_used_bytes"]
            with stopped(node):
                if streamed is None:
                    out, dt = timed(lambda: s.batch_acquire(keys, sizes))
                    assert isinstance(out, StoreUnavailable), out
                else:
                    out, dt = timed(lambda: s.fetch_range(streamed, 0, min(sizes)))
                    assert isinstance(out, StoreUnavailable), out
                    s.release(streamed)  # the worker's release: after its copy gave up
                assert dt < bound + SLACK_S, (dt, bound)
                # the abandoned get may still write into its staging: held, not reused
                assert s.ops.outstanding == 1 and s.ops.made_staging is not None
                assert s.ops.made_staging.held > 0
                assert s.ops.made_staging.used >= max(used, 1)
                fail_fast(s, keys)
            assert wait_until(lambda: s.ops.outstanding == 0, 30)
            assert s.ops.made_staging.held == 0 and s.ops.made_staging.used == 0
            assert wait_until(lambda: s.batch_exists(keys) == len(keys), 20)
            assert right_bytes(s, keys)
            lease = s.batch_acquire_streamed(keys, sizes)  # loads work again
            try:
                assert lease.keys == keys
            finally:
                s.release(lease)
    finally:
        mc.kill_node("s-node", signal.SIGTERM)


def test_a_commit_to_a_stopped_node_is_bounded_and_never_torn(mc: MooncakeCluster) -> None:
    """The save path: a commit (the put from staging to the node) gives up within its
    bound; its slot stays held until Mooncake returns the put, so a put that lands later
    carries the bytes written before the commit, never a later slot's."""
    node = mc.start_node("c-node", "64mb")
    keys = [f"c/{i}" for i in range(4)]
    try:
        with open_store(config(mc, no_space_wait_s=0.0)) as s:
            assert isinstance(s, MooncakeStore)
            assert put(s, ["c/warm"]) == [OK]
            slots = s.batch_alloc(keys, [size_of(k) for k in keys])
            assert all(x is not None for x in slots)
            for slot in slots:
                assert slot is not None
                data = payload(slot.key, slot.size)
                ctypes.memmove(slot.ptr, data.ctypes.data, slot.size)  # the layer hooks' packs
            with stopped(node):
                out, dt = timed(lambda: s.batch_commit([x for x in slots if x is not None]))
                assert out == [ERR_UNAVAILABLE] * len(keys), out
                assert dt < s.bound_s(sum(size_of(k) for k in keys)) + SLACK_S, dt
                staging = s.ops.made_staging
                assert staging is not None and staging.held > 0
                # later slots and leases never get the held bytes
                spans = [(x.ptr, x.ptr + x.size) for x in slots if x is not None]
                fresh = staging.alloc_run([64 << 10] * 64)
                assert not any(a <= p < b for p in fresh for a, b in spans)
                staging.free(fresh)
            assert wait_until(lambda: s.ops.outstanding == 0, 30)
            assert wait_until(lambda: s.health_check(), 20)
            got = get(s, keys)  # landed late (whole, right) or not at all: never torn
            for k, b in zip(keys, got):
                assert b is None or np.array_equal(b, payload(k, size_of(k))), k
    finally:
        mc.kill_node("c-node", signal.SIGTERM)
