"""A step of the vLLM worker never waits longer than its bound for a hung store (issue 31,
item 3), and never frees what a late copy job may still use: on a real local store whose
``fetch_range`` hangs (as a stopped Mooncake node's transfer would, had the store no bound
of its own), the step reports its loads as load errors within ``load_timeout_s`` (plus
the bytes at ``min_transfer_rate``), its lease is released only once the hung job
returns, that job unpacks nothing into the KV cache, and saves queued behind it are
aborted, never committed. No vLLM needed (tests/helpers/kv_worker.py)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import torch

from kvcentric.config import StoreConfig
from kvcentric.connector.vllm.settings import ConnectorSettings
from kvcentric.connector.vllm.steps import when_done
from kvcentric.connector.vllm.transfers import StepPlan
from kvcentric.connector.vllm.worker import KVCentricWorker
from kvcentric.store import ReadLease, open_store
from tests.helpers.kv_worker import caches, engine, refs, spec, stored, untouched
from tests.helpers.waiting import wait_until

LAYOUT = "cpu"
BOUND_S = 0.2  # the workers' load_timeout_s here (the bytes add well under 1 ms)
SLACK_S = 0.3  # thread wake-ups on a loaded 2-core box


class HungFetches:
    """A store whose ``fetch_range`` blocks until :attr:`go` is set; releases are logged."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.go, self.fetching = threading.Event(), threading.Event()
        self.released: list[ReadLease] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def fetch_range(self, lease: ReadLease, offset: int, size: int) -> None:
        self.fetching.set()
        self.go.wait(30)
        self.inner.fetch_range(lease, offset, size)

    def release(self, lease: ReadLease) -> None:
        self.released.append(lease)
        self.inner.release(lease)


def hung_worker(cfg: StoreConfig, kv: dict[str, torch.Tensor]) -> tuple[KVCentricWorker,
                                                                         HungFetches]:
    store = HungFetches(open_store(cfg))
    w = KVCentricWorker(ConnectorSettings(store=cfg, load_timeout_s=BOUND_S), engine(LAYOUT),
                        store, list(kv))  # type: ignore[arg-type]
    w.register(kv)
    return w, store


def test_a_hung_fetch_fails_the_step_in_time_and_keeps_its_lease(store_cfg: StoreConfig) -> None:
    stored(store_cfg, LAYOUT, "hung", 3)
    kv = caches(LAYOUT, "cpu", seed=None)
    w, store = hung_worker(store_cfg, kv)
    dst = [[10, 11], [12, 13], [14, 15]]
    try:
        t0 = time.monotonic()
        w.start_load(StepPlan(loads=[spec("r", refs("hung", 3), dst)]))
        for name in kv:
            w.wait_for_layer(name)
        w.finish_step()
        took = time.monotonic() - t0
        errors = w.take_load_errors()
        assert took < BOUND_S + SLACK_S, took
        assert errors == {p for ps in dst for p in ps}
        assert store.fetching.is_set() and store.released == []  # the job still runs
        assert store.inner.stats()["leases"] == 1
        store.go.set()  # the store answers at last
        # the lease is released only once every job of the step has returned (the worker
        # releases on its jobs' futures): from here the late job can touch nothing more
        assert wait_until(lambda: len(store.released) == 1, 10)
        assert wait_until(lambda: store.inner.stats()["leases"] == 0, 10)
        assert untouched(kv)  # the late job unpacked nothing: vLLM recomputes those pages
        # the next step loads normally
        assert _load(w, kv, "hung", dst) == set() and not untouched(kv)
    finally:
        store.go.set()
        w.close()


def test_saves_behind_a_hung_load_are_aborted_never_committed(store_cfg: StoreConfig) -> None:
    stored(store_cfg, LAYOUT, "old", 2)
    kv = caches(LAYOUT, "cpu", seed=5)
    w, store = hung_worker(store_cfg, kv)
    new = refs("new", 2)
    try:
        w.start_load(StepPlan(loads=[spec("r", refs("old", 2), [[20, 21], [22, 23]])]))
        w.plan_saves(StepPlan(saves=[spec("s", new, [[0, 1], [2, 3]])], commit_now=True))
        t0 = time.monotonic()
        for name, layer in kv.items():
            w.wait_for_layer(name)
            w.save_layer(name, layer)  # packs queue behind the hung load on the copy thread
        w.finish_step()
        assert time.monotonic() - t0 < 2 * BOUND_S + SLACK_S
        assert w.take_load_errors() and w.stats.data["saved_blocks"] == 0
        store.go.set()
        assert wait_until(lambda: store.inner.stats()["pending"] == 0, 10)
        keys = [r.key(engine(LAYOUT).keyspace) for r in new]
        assert store.inner.batch_exists(keys) == 0  # aborted, never visible
    finally:
        store.go.set()
        w.close()


def _load(w: KVCentricWorker, kv: dict[str, torch.Tensor], tag: str,
          pages: list[list[int]]) -> set[int]:
    w.start_load(StepPlan(loads=[spec("again", refs(tag, len(pages)), pages)]))
    for name in kv:
        w.wait_for_layer(name)
    w.finish_step()
    return w.take_load_errors()


def test_when_done_runs_once_after_every_future_even_cancelled_ones() -> None:
    futs: list[Future[None]] = [Future(), Future(), Future()]
    ran: list[int] = []
    when_done(futs, lambda: ran.append(1))
    futs[0].set_result(None)
    assert futs[1].cancel()
    assert ran == []
    futs[2].set_result(None)
    assert ran == [1]
    when_done([], lambda: ran.append(2))  # nothing to wait for: at once
    assert ran == [1, 2]
