"""Hybrid models (vLLM's ``SupportsHMA``) without an engine: vLLM's own KV cache specs and
``Request`` objects through our scheduler side, the real worker on vLLM-CPU-shaped caches,
a real local store.

An engine of three KV cache groups as vLLM's hybrid manager makes them: full attention
(layer 1), a sliding window of two pages (layers 0 and 2) and a recurrent state in mode
``align`` (layer 3, short-conv shaped: one state tensor inside a padded page).

- Block objects hold every attention layer, each from its own group's block table; a
  reader writes only the pages its sliding group holds (the window before the hit's end;
  the null block and older pages are never touched).
- The state at a block boundary is an object of its own; a hit ends where one is stored
  (no tails), and loads are asynchronous: failures are reported per request.
- Keys and headers bind the groups: another group layout is another key space.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from kvcentric.config import StoreConfig
from kvcentric.connector.vllm.engine_layout import EngineLayout, engine_layout
from kvcentric.connector.vllm.groups import NULL_BLOCK, group_plan
from kvcentric.connector.vllm.mover import SKIP
from kvcentric.connector.vllm.scheduler import KVCentricScheduler
from kvcentric.connector.vllm.settings import ConnectorSettings
from kvcentric.connector.vllm.states import state_pages
from kvcentric.connector.vllm.transfers import StepPlan, TransferSpec
from kvcentric.connector.vllm.worker import KVCentricWorker
from kvcentric.integrity import ObjectRef
from kvcentric.store import KVStore, open_store
from tests.connector.test_worker_bounds import BOUND_S, SLACK_S, HungFetches
from tests.helpers.kv_worker import transfers
from tests.helpers.waiting import wait_until

BS, H, D, NB, WINDOW = 16, 2, 32, 40, 32  # page tokens, KV heads, head dim, blocks, window
PAGE = H * BS * 2 * D * 4  # float32 vLLM CPU page: [H, BS, 2 * D]
CONV = (3, 64)  # the recurrent layer's state: one float32 tensor, padded to PAGE
FULL, SLIDING, STATE = 0, 1, 2  # group ids
NAMES = {0: SLIDING, 1: FULL, 2: SLIDING, 3: STATE}


def layer(i: int) -> str:
    return f"model.layers.{i}.attn"


def kv_cache_config(mode: str = "align") -> KVCacheConfig:
    full = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
    sliding = SlidingWindowSpec(block_size=BS, num_kv_heads=H, head_size=D,
                                dtype=torch.float32, sliding_window=WINDOW)
    state = MambaSpec(block_size=BS, shapes=(CONV,), dtypes=(torch.float32,),
                      page_size_padded=PAGE, mamba_cache_mode=mode)
    groups = [KVCacheGroupSpec([layer(i) for i, g in NAMES.items() if g == gid], spec)
              for gid, spec in ((FULL, full), (SLIDING, sliding), (STATE, state))]
    return KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=groups)


def vllm_config() -> Any:
    return SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype="auto"),
        device_config=SimpleNamespace(device_type="cpu"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1),
        model_config=SimpleNamespace(model="hybrid", revision=None))


def hybrid(mode: str = "align") -> EngineLayout:
    return engine_layout(vllm_config(), kv_cache_config(mode), BS, "hybrid")


def caches(seed: int | None) -> dict[str, Any]:
    """Attention layers as vLLM CPU allocates them; the recurrent layer as vLLM's list of
    state views into one buffer of padded pages. Random bits (``seed``) or zeros."""
    gen = torch.Generator().manual_seed(seed or 0)

    def bits(n: int) -> torch.Tensor:
        if seed is None:
            return torch.zeros(n, dtype=torch.int32)
        return torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=gen)

    out: dict[str, Any] = {layer(i): bits(NB * PAGE // 4).view(torch.float32).view(NB, H, BS, 2 * D)
                           for i in (0, 1, 2)}
    raw = bits(NB * PAGE // 4).view(torch.float32)
    out[layer(3)] = [raw.as_strided((NB, *CONV), (PAGE // 4, CONV[1], 1))]
    return out


def page_of(kv: dict[str, Any], i: int, block: int) -> torch.Tensor:
    t = kv[layer(i)]
    return (t[0][block] if isinstance(t, list) else t[block]).view(torch.int32).clone()


@pytest.fixture
def store(store_cfg: StoreConfig) -> Iterator[StoreConfig]:
    yield store_cfg


def worker(cfg: StoreConfig, eng: EngineLayout, kv: dict[str, Any]) -> KVCentricWorker:
    assert eng.groups is not None
    w = KVCentricWorker(ConnectorSettings(store=cfg), eng, open_store(cfg), list(eng.groups.layers))
    w.register(kv)
    return w


def refs(n: int) -> list[ObjectRef]:
    return [ObjectRef(bytes([i]) * 16, i, BS) for i in range(n)]


def test_groups_become_block_and_state_objects_and_sign_the_keys() -> None:
    eng = hybrid()
    g = eng.groups
    assert g is not None and g.hybrid and not g.unservable
    assert g.layers == tuple(layer(i) for i in (0, 1, 2)) and g.layer_group == (1, 0, 1)
    assert g.state_layers == (layer(3),) and eng.async_loads and not eng.tails
    assert eng.geometry.num_layers == 3 and eng.geometry.page_bytes == PAGE
    assert eng.state_geometry is not None and eng.state_geometry.page_bytes == 3 * 64 * 4
    # another window, or no state group: another key space
    other = kv_cache_config()
    window = other.kv_cache_groups[SLIDING].kv_cache_spec
    assert isinstance(window, SlidingWindowSpec)
    other.kv_cache_groups[SLIDING].kv_cache_spec = replace(window, sliding_window=2 * WINDOW)
    no_state = kv_cache_config()
    del no_state.kv_cache_groups[STATE]
    sigs = {engine_layout(vllm_config(), c, BS, "hybrid").keyspace.prefix
            for c in (other, no_state)}
    assert len(sigs | {eng.keyspace.prefix}) == 3
    # a group kind we do not know is refused, never guessed
    odd = kv_cache_config()
    odd.kv_cache_groups.append(KVCacheGroupSpec(["x"], SimpleNamespace(block_size=BS)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot store KV cache group 3"):
        group_plan(odd, BS)


def test_a_state_group_outside_align_mode_is_not_served() -> None:
    eng = hybrid("none")
    assert eng.groups is not None and "'none'" in eng.groups.unservable
    assert not eng.servable and eng.state_geometry is None


def test_sliding_groups_load_only_their_window() -> None:
    g = hybrid().groups
    assert g is not None
    tables = [[11, 12, 13, 14], [NULL_BLOCK, NULL_BLOCK, 17, 18], [0, 0, 0, 19]]
    # a 4-block hit (64 tokens): the window of the next token starts in page 2
    assert g.load_pages(tables, 0, 4, 1, 0, 4, 64) == [
        [11, SKIP], [12, SKIP], [13, 17], [14, 18]]
    assert g.state_page(tables, 64) == [19] and g.state_page(tables, 48) is None
    # a page a group no longer holds is never saved (it would store another page's bytes)
    assert g.save_pages(tables, 0, 1) is None and g.save_pages(tables, 3, 1) == [14, 18]


def test_hybrid_objects_load_bit_exact_into_the_pages_each_group_holds(
        store: StoreConfig) -> None:
    eng = hybrid()
    g = eng.groups
    assert g is not None
    src = caches(seed=1)
    wt = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    objs = refs(4)
    state = ObjectRef(objs[-1].digest, 3, BS, state=True)
    w = worker(store, eng, src)
    try:
        w.plan_saves(StepPlan(
            saves=[TransferSpec("w", objs, [g.save_pages(wt, b, 1) or [] for b in range(4)],
                                [None, *objs[:-1]])],
            state_saves=[TransferSpec("w", [state], [g.state_page(wt, 64) or []], [objs[-1]])],
            commit_now=True))
        for name in g.layers:
            w.save_layer(name, src[name])
        w.finish_step()
        assert w.stats.data["saved_blocks"] == 4 and w.stats.data["saved_states"] == 1
    finally:
        w.close()
    dst = caches(seed=None)
    rt = [[21, 22, 23, 24], [NULL_BLOCK, NULL_BLOCK, 27, 28], [0, 0, 0, 29]]
    r = worker(store, eng, dst)
    try:
        pages, state_page = g.load_pages(rt, 0, 4, 1, 0, 4, 64), g.state_page(rt, 64) or []
        r.start_load(StepPlan(loads=[TransferSpec("r", objs, pages)],
                              state_loads=[TransferSpec("r", [state], [state_page])]))
        r.finish_step()
        assert transfers(r, {"r"}) == ({"r"}, set()) and r.take_load_errors() == set()
        assert r.stats.data["graph_steps"] == 0  # a hooked step, loaded before its forward
    finally:
        r.close()
    for b in range(4):
        assert torch.equal(page_of(dst, 1, 21 + b), page_of(src, 1, 1 + b))  # full: all
    for i in (0, 2):  # sliding: the window's pages, nothing else (the null block neither)
        assert torch.equal(page_of(dst, i, 27), page_of(src, i, 7))
        assert torch.equal(page_of(dst, i, 28), page_of(src, i, 8))
        assert not page_of(dst, i, NULL_BLOCK).any() and not page_of(dst, i, 21).any()
    assert torch.equal(page_of(dst, 3, 29), page_of(src, 3, 12))  # the state
    padding = dst[layer(3)][0].untyped_storage()  # bytes past the state: never written
    raw = torch.empty(0, dtype=torch.uint8).set_(padding).view(NB, PAGE)
    assert not raw[29, 3 * 64 * 4:].any()


def test_failed_hybrid_loads_are_reported_per_request(store: StoreConfig) -> None:
    """A missing block, a missing state, a state written for another block: the request
    is reported failed (vLLM recomputes it), never as block ids (vLLM cannot map those
    back to a request when there are several groups), and nothing is written."""
    eng = hybrid()
    g = eng.groups
    assert g is not None
    objs = refs(2)
    rt = [[21, 22], [27, 28], [0, 29]]
    with open_store(store) as st:  # a state stored under block 1's key, written for block 0
        headers = eng.state_headers()
        assert headers is not None
        buf = torch.zeros(headers.object_bytes, dtype=torch.uint8)
        headers.write(buf.data_ptr(), ObjectRef(objs[0].digest, 0, BS, state=True))
        key = ObjectRef(objs[1].digest, 1, BS, state=True).key(eng.keyspace)
        assert st.batch_put_from([key], [buf.data_ptr()], [headers.object_bytes]) == [0]
    dst = caches(seed=None)
    r = worker(store, eng, dst)
    try:
        r.start_load(StepPlan(
            loads=[TransferSpec("blocks", objs, g.load_pages(rt, 0, 2, 1, 0, 2, 32))],
            state_loads=[TransferSpec("forged", [ObjectRef(objs[1].digest, 1, BS, state=True)],
                                      [[29]]),
                         TransferSpec("absent", [ObjectRef(b"x" * 16, 1, BS, state=True)],
                                      [[29]]),
                         TransferSpec("nowhere", [ObjectRef(objs[1].digest, 1, BS, state=True)],
                                      [[SKIP]])]))
        r.finish_step()
        done, failed = transfers(r, {"blocks", "forged", "absent", "nowhere"})
        assert done == failed == {"blocks", "forged", "absent", "nowhere"}
        assert r.take_load_errors() == set() and r.stats.data["integrity_errors"] == 1
    finally:
        r.close()
    assert all(not (t[0] if isinstance(t, list) else t).any() for t in dst.values())


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), None)  # type: ignore[arg-type]


def step(reqs: list[tuple[Request, list[list[int]], int]]) -> SchedulerOutput:
    """A scheduler output in which each new request computes ``n`` tokens."""
    return SchedulerOutput(
        scheduled_new_reqs=[NewRequestData.from_request(r, tuple(t)) for r, t, _ in reqs],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={r.request_id: n for r, _, n in reqs},
        total_num_scheduled_tokens=sum(n for _, _, n in reqs),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(), free_encoder_mm_hashes=[])


def test_hybrid_hits_end_on_a_stored_state_and_load_asynchronously(store_cfg: StoreConfig
                                                                   ) -> None:
    eng = hybrid()
    tokens = list(range(100, 100 + 4 * BS + 5))  # 4 blocks and 5 tokens
    with open_store(store_cfg) as st:
        sched = KVCentricScheduler(ConnectorSettings(), eng, st, loads=True, saves=True)
        w = sched
        # the writer's step that ends on block 3's boundary plans block and state saves
        a = request("a", tokens)
        sched.register_request(a)
        assert sched.get_num_new_matched_tokens(a, 0) == (0, False)  # nothing stored yet
        tables = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
        meta = sched.build_connector_meta(step([(a, tables, 4 * BS)]))
        assert [len(s.refs) for s in meta.saves] == [4] and len(meta.state_saves) == 1
        assert meta.state_saves[0].page_ids == [[12]] and meta.state_saves[0].refs[0].state
        assert meta.saves[0].page_ids == [[1, 5], [2, 6], [3, 7], [4, 8]]
        _store(st, eng, [r for s in meta.saves for r in s.refs])
        b = request("b", tokens)
        sched.register_request(b)
        # blocks but no state yet: no hit (vLLM recomputes), never a partial one
        assert sched.get_num_new_matched_tokens(b, 0) == (0, False)
        _store(st, eng, meta.state_saves[0].refs, state=True)
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * BS, True)  # no tail, async
        blocks = SimpleNamespace(get_block_ids=lambda: ([21, 22, 23, 24], [0, 0, 27, 28],
                                                        [0, 0, 0, 29]))
        sched.update_state_after_alloc(b, blocks, 4 * BS)
        meta = w.build_connector_meta(step([]))
        assert meta.loads[0].page_ids == [[21, SKIP], [22, SKIP], [23, 27], [24, 28]]
        assert meta.state_loads[0].page_ids == [[29]]
        # a load a worker reports failed is recomputed by vLLM and never retried
        sched.loads_failed({"b"})
        assert sched.get_num_new_matched_tokens(b, 0) == (0, False)


def _store(st: KVStore, eng: EngineLayout, refs: list[ObjectRef], state: bool = False) -> None:
    headers = eng.state_headers() if state else eng.headers()
    assert headers is not None
    buf = torch.zeros(headers.object_bytes, dtype=torch.uint8)
    for ref in refs:
        headers.write(buf.data_ptr(), ref)
        assert st.batch_put_from([ref.key(eng.keyspace)], [buf.data_ptr()],
                                 [headers.object_bytes]) == [0]


def test_state_pages_refuse_a_layout_the_configs_did_not_describe() -> None:
    raw = torch.zeros(NB * PAGE // 4, dtype=torch.float32)
    conv = raw.as_strided((NB, *CONV), (PAGE // 4, CONV[1], 1))
    assert state_pages([conv], 3 * 64 * 4).shape == (NB, 3 * 64 * 4)
    with pytest.raises(ValueError, match="spans"):
        state_pages([conv], 3 * 64 * 4 + 4)


def test_a_hung_hybrid_load_fails_its_request_in_time_and_keeps_its_lease(
        store: StoreConfig) -> None:
    """The worker's bounded waits hold for a hybrid model's asynchronous loads: a fetch
    that hangs fails the request (reported per request, never as block ids) within
    ``load_timeout_s``; the lease is released only once the fetch returns, and the late
    job writes nothing into any group's pages."""
    eng = hybrid()
    g = eng.groups
    assert g is not None
    src = caches(seed=2)
    wt = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    objs = refs(2)
    w = worker(store, eng, src)
    try:
        w.plan_saves(StepPlan(saves=[TransferSpec(
            "w", objs, [g.save_pages(wt, b, 1) or [] for b in range(2)], [None, objs[0]])],
            commit_now=True))
        for name in g.layers:
            w.save_layer(name, src[name])
        w.finish_step()
        assert w.stats.data["saved_blocks"] == 2
    finally:
        w.close()
    dst = caches(seed=None)
    hung = HungFetches(open_store(store))
    r = KVCentricWorker(ConnectorSettings(store=store, load_timeout_s=BOUND_S), eng, hung,  # type: ignore[arg-type]
                        list(g.layers))
    r.register(dst)
    try:
        t0 = time.monotonic()
        r.start_load(StepPlan(loads=[TransferSpec(
            "r", objs, g.load_pages([[21, 22], [23, 24], [0, 29]], 0, 2, 1, 0, 2, 32))]))
        r.finish_step()
        assert transfers(r, {"r"}) == ({"r"}, {"r"}) and r.take_load_errors() == set()
        assert time.monotonic() - t0 < BOUND_S + SLACK_S
        assert hung.fetching.is_set() and hung.released == []  # the job still runs
        hung.go.set()
        # released only once every job of the step returned: the late job is done
        assert wait_until(lambda: len(hung.released) == 1, 10)
        assert all(not (t[0] if isinstance(t, list) else t).any() for t in dst.values())
    finally:
        hung.go.set()
        r.close()
