"""Asynchronous loads (the connector's ``async_loads``, by default on a P/D decode
instance): ``start_load`` returns at once, the steps after it run and save while the copy
is under way, and the request is reported done (vLLM's ``get_finished``) only once its
pages hold the stored bytes, or, past the step's bound, with every page reported for
recompute and the lease kept until the late job returns. On a real local store, through
the worker vLLM drives (tests/helpers/kv_worker.py); CPU here, CUDA marked ``gpu``."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kvcentric.config import StoreConfig
from kvcentric.connector.vllm.scheduler import KVCentricScheduler
from kvcentric.connector.vllm.settings import ConnectorSettings
from kvcentric.connector.vllm.transfers import StepPlan
from kvcentric.connector.vllm.worker import KVCentricWorker
from kvcentric.store import open_store
from tests.connector.test_vllm_hybrid import step
from tests.connector.test_vllm_keys import request, store_objects
from tests.connector.test_worker_bounds import BOUND_S, SLACK_S, HungFetches
from tests.helpers.kv_worker import (
    DEVICES,
    caches,
    engine,
    refs,
    same_pages,
    spec,
    stored,
    transfers,
    untouched,
)
from tests.helpers.waiting import wait_until

LAYOUT = "flash_attn"


def async_worker(cfg: StoreConfig, kv: dict[str, torch.Tensor]
                 ) -> tuple[KVCentricWorker, HungFetches]:
    """A worker with asynchronous loads over a store whose fetches wait for ``go``."""
    store = HungFetches(open_store(cfg))
    w = KVCentricWorker(ConnectorSettings(store=cfg, load_timeout_s=BOUND_S),
                        replace(engine(LAYOUT), load_async=True), store,  # type: ignore[arg-type]
                        list(kv))
    w.register(kv)
    return w, store


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_runs_beside_the_steps_and_is_done_only_once_its_pages_hold_it(
        store_cfg: StoreConfig, device: str) -> None:
    src, src_pages = stored(store_cfg, LAYOUT, "beside", 3, device)
    kv = caches(LAYOUT, device, seed=None)
    w, store = async_worker(store_cfg, kv)
    dst = [[10, 11], [12, 13], [14, 15]]
    new = refs("saved-meanwhile", 1)
    try:
        w.start_load(StepPlan(loads=[spec("r", refs("beside", 3), dst)]))
        assert store.fetching.wait(10)  # the copy is under way and held there
        # the steps go on: no layer waits for the load, and a save is committed behind it
        w.plan_saves(StepPlan(saves=[spec("s", new, [[0, 1]])], commit_now=True))
        for name, layer in kv.items():
            w.wait_for_layer(name)
            w.save_layer(name, layer)
        w.finish_step()
        assert w.stats.data["saved_blocks"] == 1
        assert w.take_transfer_results() == (set(), set())  # not done: vLLM keeps it waiting
        assert untouched(kv)  # nothing unpacked while the fetch is held
        store.go.set()
        assert transfers(w, {"r"}) == ({"r"}, set())
        assert w.take_load_errors() == set()
        assert same_pages(kv, src, LAYOUT, dst, src_pages)
        assert wait_until(lambda: store.inner.stats()["leases"] == 0, 10)
        assert w.stats.data["loaded_blocks"] == 3
    finally:
        store.go.set()
        w.close()


def test_a_load_past_its_bound_is_recomputed_and_its_lease_kept_until_the_job_returns(
        store_cfg: StoreConfig) -> None:
    stored(store_cfg, LAYOUT, "late", 2)
    kv = caches(LAYOUT, "cpu", seed=None)
    w, store = async_worker(store_cfg, kv)
    dst = [[4, 5], [6, 7]]
    try:
        t0 = time.monotonic()
        w.start_load(StepPlan(loads=[spec("r", refs("late", 2), dst)]))
        w.finish_step()
        assert transfers(w, {"r"}) == ({"r"}, set())
        assert time.monotonic() - t0 < BOUND_S + SLACK_S
        assert w.take_load_errors() == {p for ps in dst for p in ps}  # vLLM recomputes them
        assert store.fetching.is_set() and store.released == []  # the job still runs
        store.go.set()
        assert wait_until(lambda: len(store.released) == 1, 10)
        assert untouched(kv)  # the late job unpacked nothing
    finally:
        store.go.set()
        w.close()


def test_a_missing_object_is_reported_with_the_pages_after_it(store_cfg: StoreConfig) -> None:
    stored(store_cfg, LAYOUT, "half", 1)
    kv = caches(LAYOUT, "cpu", seed=None)
    w, store = async_worker(store_cfg, kv)
    store.go.set()
    asked = refs("half", 2)  # the second was never stored
    try:
        w.start_load(StepPlan(loads=[spec("r", asked, [[1, 2], [3, 4]])]))
        w.finish_step()
        assert transfers(w, {"r"}) == ({"r"}, set())
        assert w.take_load_errors() == {3, 4}
        assert not untouched(kv)  # the first object loaded
    finally:
        w.close()


def test_suspending_waits_for_loads_in_flight(store_cfg: StoreConfig) -> None:
    """vLLM's sleep mode remaps the cache after ``suspend``: no copy may still run."""
    src, src_pages = stored(store_cfg, LAYOUT, "sleep", 2)
    kv = caches(LAYOUT, "cpu", seed=None)
    w, store = async_worker(store_cfg, kv)
    dst = [[8, 9], [10, 11]]
    try:
        w.start_load(StepPlan(loads=[spec("r", refs("sleep", 2), dst)]))
        assert store.fetching.wait(10)
        store.go.set()
        w.suspend()
        assert same_pages(kv, src, LAYOUT, dst, src_pages)
        assert wait_until(lambda: store.inner.stats()["leases"] == 0, 10)
        w.resume()
        assert w.take_transfer_results() == ({"r"}, set()) and w.take_load_errors() == set()
    finally:
        w.close()


def test_decode_instances_load_asynchronously_unless_told_otherwise() -> None:
    default = ConnectorSettings()
    assert default.loads_async("kv_consumer") and not default.loads_async("kv_both")
    assert not default.loads_async("kv_producer")
    on = ConnectorSettings.from_extra_config({"async_loads": True})
    off = ConnectorSettings.from_extra_config({"async_loads": False})
    assert on.loads_async("kv_both") and not off.loads_async("kv_consumer")
    with pytest.raises(ValueError, match="async_loads"):
        ConnectorSettings.from_extra_config({"async_loads": "sometimes"})
    eng = engine(LAYOUT)
    assert not eng.async_loads and replace(eng, load_async=True).async_loads
    assert not replace(eng, load_async=True).failures_by_request


def test_a_request_sent_back_after_its_load_failed_is_recomputed_never_reloaded(
        store_cfg: StoreConfig) -> None:
    """vLLM returns a request whose asynchronous load failed from its first block to the
    waiting queue with nothing computed, and looks it up again: a second load of the same
    (corrupt) objects would fail again, forever. It is recomputed instead; a request
    looked up again after a preemption loads as before."""
    eng = replace(engine("cpu"), load_async=True)
    tokens = list(range(100, 170))
    pages = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5],))
    with open_store(store_cfg) as st:
        sched = KVCentricScheduler(ConnectorSettings(), eng, st, loads=True, saves=True)
        store_objects(st, eng, sched.object_refs(request("w", tokens), len(tokens)))
        failed, preempted = request("failed", tokens), request("preempted", tokens)
        for r in (failed, preempted):
            sched.register_request(r)
            assert sched.get_num_new_matched_tokens(r, 0) == (len(tokens) - 1, True)
            sched.update_state_after_alloc(r, pages, len(tokens) - 1)
        assert {s.req_id for s in sched.build_connector_meta(step([])).loads} == {
            "failed", "preempted"}
        assert sched.get_num_new_matched_tokens(failed, 0) == (0, False)
        assert sched.get_num_new_matched_tokens(failed, 0) == (0, False)  # for good
        preempted.num_preemptions += 1
        assert sched.get_num_new_matched_tokens(preempted, 0) == (len(tokens) - 1, True)
        assert sched.stats.data["failed_requests"] == 1
