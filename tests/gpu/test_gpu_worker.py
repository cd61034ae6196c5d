"""The real ``KVCentricWorker`` on vLLM-shaped caches and a real local store: pages saved
by one worker load bit-exact into another worker's zeroed cache, for every layout vLLM
allocates (no vLLM needed: the worker data path does not import it).

Runs on CPU (layouts, block dims, the worker's plumbing) and, marked ``gpu``, on CUDA:
pinned store memory, staged copies (HBM gather, 2-D DMA), the copy stream ordered by
events. A forward-pass stand-in writes each layer right before its save behind a long GPU
sleep, so a pack that did not wait for the compute stream would store stale bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from kvcentric.config import StoreConfig
from kvcentric.connector.vllm.mover import SKIP
from kvcentric.connector.vllm.transfers import StepPlan
from kvcentric.store import open_store
from tests.helpers.kv_worker import (
    DEVICES,
    NB,
    SHAPES,
    caches,
    engine,
    load,
    page,
    refs,
    same_pages,
    save,
    spec,
    untouched,
    worker,
)


@pytest.fixture
def store(store_cfg: StoreConfig) -> Iterator[StoreConfig]:
    yield store_cfg


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(SHAPES))
def test_saved_pages_load_bit_exact_into_another_cache(store: StoreConfig, layout: str,
                                                        device: str) -> None:
    src_kv, dst_kv = caches(layout, device, seed=1), caches(layout, device, seed=None)
    keys = refs("obj", 3)
    src_pages = [[5, 9], [0, 23], [12, 7]]
    dst_pages = [[1, 2], [3, 4], [SKIP, 6]]  # the engine already has one page: untouched
    src, dst = worker(store, layout, src_kv), worker(store, layout, dst_kv)
    try:
        save(src, src_kv, StepPlan(saves=[spec("r1", keys, src_pages)], commit_now=True))
        assert src.stats.data["saved_blocks"] == 3
        if device == "cuda":  # load under another compute stream than the default one
            with torch.cuda.stream(torch.cuda.Stream()):
                errors = load(dst, dst_kv, StepPlan(loads=[spec("r2", keys, dst_pages)]))
            torch.cuda.synchronize()
        else:
            errors = load(dst, dst_kv, StepPlan(loads=[spec("r2", keys, dst_pages)]))
    finally:
        src.close()
        dst.close()
    assert errors == set()
    for name in src_kv:
        for sp, dp in zip(src_pages, dst_pages, strict=True):
            for s, d in zip(sp, dp, strict=True):
                if d != SKIP:
                    assert torch.equal(page(dst_kv[name], layout, d),
                                       page(src_kv[name], layout, s))
        untouched = [b for b in range(NB) if b not in {p for ps in dst_pages for p in ps}]
        assert all(not page(dst_kv[name], layout, b).any() for b in untouched)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "mla"])
def test_saves_wait_for_the_layer_written_by_the_forward(store: StoreConfig,
                                                         layout: str) -> None:
    kv = caches(layout, "cuda", seed=None)
    keys = refs("ord", 4)
    pages = [[2 * i, 2 * i + 1] for i in range(4)]
    w = worker(store, layout, kv)
    compute = torch.cuda.Stream()

    def forward(i: int, layer: torch.Tensor) -> None:
        torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time before the write lands
        layer.fill_(float(i + 1))

    try:
        with torch.cuda.stream(compute):
            save(w, kv, StepPlan(saves=[spec("r", keys, pages)], commit_now=True), forward)
        got = caches(layout, "cuda", seed=None)
        reader = worker(store, layout, got)
        assert load(reader, got, StepPlan(loads=[spec("r2", keys, pages)])) == set()
        reader.close()
    finally:
        w.close()
    torch.cuda.synchronize()
    for i, name in enumerate(got):
        want = torch.full_like(got[name].select(SHAPES[layout][1], 0), float(i + 1))
        for block in range(8):
            assert torch.equal(got[name].select(SHAPES[layout][1], block), want), (name, block)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_worker_pins_the_store_arena_and_stages_copies(store: StoreConfig) -> None:
    kv = caches("flash_attn", "cuda", seed=3)
    w = worker(store, "flash_attn", kv)
    try:
        path = w._path
        assert path.pinner is not None
        assert path.pinner.registered_bytes >= store.local.capacity_bytes
        assert path.ordering is not None and path.kernel.block_dim == 1
        assert path.kernel.staged  # gathered in HBM, one DMA per object and layer
        assert path.kernel.pack_impl == path.kernel.unpack_impl == "auto"  # torch in HBM
    finally:
        w.close()
    assert path.pinner.registered_bytes == 0  # unregistered before the arena is unmapped


@pytest.mark.parametrize("device", DEVICES)
def test_each_tp_rank_stores_and_loads_its_own_shard(store: StoreConfig, device: str) -> None:
    """A TP engine's scheduler sends every rank the same plan; each rank keys the objects
    in its own key space, so both shards are stored and each rank reads back its own."""
    layout, objs, pages = "flash_attn", refs("tp", 2), [[0, 1], [2, 3]]
    shards = [caches(layout, device, seed=10 + r) for r in range(2)]
    plan = StepPlan(saves=[spec("r", objs, pages)], commit_now=True)
    for r in range(2):
        w = worker(store, layout, shards[r], rank=r)
        try:
            save(w, shards[r], plan)
            assert w.stats.data["saved_blocks"] == 2  # rank 1 is not refused as "exists"
        finally:
            w.close()
    for r in (1, 0):
        got = caches(layout, device, seed=None)
        w = worker(store, layout, got, rank=r)
        try:
            assert load(w, got, StepPlan(loads=[spec("r2", objs, pages)])) == set()
        finally:
            w.close()
        assert same_pages(got, shards[r], layout, pages, pages)
        assert not same_pages(got, shards[1 - r], layout, pages, pages)


@pytest.mark.parametrize("device", DEVICES)
def test_objects_written_for_another_block_rank_or_format_are_never_loaded(
        store: StoreConfig, device: str) -> None:
    """The integrity header: an object under the key a load asks for, but written for
    another rank, another block position or in another format, is caught before a byte
    of it is unpacked: every page of the step is reported for recompute, none written."""
    layout, objs, pages = "flash_attn", refs("hdr", 2), [[0, 1], [2, 3]]
    src = caches(layout, device, seed=5)
    w0 = worker(store, layout, src, rank=0)
    try:
        save(w0, src, StepPlan(saves=[spec("r", objs, pages)], commit_now=True))
    finally:
        w0.close()
    eng0 = replace(engine(layout).keyspace, tp_rank=0, tp_size=2)
    eng1 = replace(eng0, tp_rank=1)
    st = open_store(store)
    try:  # rank 0's bytes under rank 1's key: what the TP bug used to store
        lease = st.batch_acquire([o.key(eng0) for o in objs])
        assert st.batch_put_from([o.key(eng1) for o in objs], lease.ptrs, lease.sizes) == [0, 0]
        st.release(lease)
        size = lease.sizes[0]
        junk = torch.randint(0, 256, (size,), dtype=torch.uint8)  # no header at all
        assert st.batch_put_from([o.key(eng0) for o in refs("junk", 1)],
                                 [junk.data_ptr()], [size]) == [0]
    finally:
        st.close()
    moved = [o for o in objs]  # the right key, but the plan expects another block index
    moved[1] = replace(objs[1], index=7)
    cases = [(1, objs, pages), (0, moved, pages), (0, refs("junk", 1), pages[:1])]
    for rank, asked, want_pages in cases:
        got = caches(layout, device, seed=None)
        w = worker(store, layout, got, rank=rank)
        try:
            errors = load(w, got, StepPlan(loads=[spec("r2", asked, want_pages)]))
            assert errors == {p for ps in want_pages for p in ps}, (rank, asked)
            assert w.stats.data["integrity_errors"] >= 1
        finally:
            w.close()
        if device == "cuda":
            torch.cuda.synchronize()
        assert untouched(got), (rank, asked)


@pytest.mark.parametrize("device", DEVICES)
def test_steps_without_layer_hooks_load_before_and_save_after_the_forward(
        store: StoreConfig, device: str) -> None:
    """A step replaying a full CUDA graph runs no layer hooks: ``start_load(hooks_run=
    False)`` returns with every layer loaded (ordered before the compute stream's next
    work), and ``finish_step`` saves every layer itself."""
    layout, objs, pages = "flash_attn", refs("graph", 3), [[4, 5], [6, 7], [8, 9]]
    src = caches(layout, device, seed=6)
    w = worker(store, layout, src)
    try:
        w.plan_saves(StepPlan(saves=[spec("r", objs, pages)], commit_now=True))
        w.finish_step()  # no save_layer call: the forward ran as one graph
        assert w.stats.data["saved_blocks"] == 3
    finally:
        w.close()
    got = caches(layout, device, seed=None)
    r = worker(store, layout, got)
    try:
        r.start_load(StepPlan(loads=[spec("r2", objs, pages)]), hooks_run=False)
        if device == "cuda":  # what the next kernel on the compute stream would see
            torch.cuda.current_stream().synchronize()
        assert same_pages(got, src, layout, pages, pages)  # before the step ends
        r.finish_step()
        assert r.take_load_errors() == set() and r.stats.data["graph_steps"] == 1
    finally:
        r.close()


@pytest.mark.parametrize("device", DEVICES)
def test_sleep_mode_drains_then_resumes_on_the_same_caches(store: StoreConfig,
                                                           device: str) -> None:
    """vLLM 0.33's sleep mode, in its order: steps, ``unregister_kv_caches`` (transfers
    drained; the cache's memory is then remapped and its contents lost), nothing touches
    the cache while asleep, ``restore_kv_caches``, steps on the same tensors."""
    layout, objs, pages = "flash_attn", refs("sleep", 2), [[0, 1], [2, 3]]
    kv = caches(layout, device, seed=7)
    want = {name: t.clone() for name, t in kv.items()}
    w = worker(store, layout, kv)  # async commits: the save below is still in flight
    try:
        w.plan_saves(StepPlan(saves=[spec("s", objs, pages)]))
        for name, layer in kv.items():
            w.save_layer(name, layer)
        w.finish_step()
        w.suspend()
        assert w.stats.data["saved_blocks"] == 2  # the pending commit landed before sleep
        for t in kv.values():
            t.zero_()  # level 1 sleep discards the cache's contents
        w.suspend()  # idempotent
        assert load(w, kv, StepPlan(loads=[spec("x", objs, pages)])) == {0, 1, 2, 3}
        assert untouched(kv)  # asleep: reported for recompute, never written
        w.resume()
        w.resume()
        assert load(w, kv, StepPlan(loads=[spec("x", objs, pages)])) == set()
        if device == "cuda":
            torch.cuda.synchronize()
        assert same_pages(kv, want, layout, pages, pages)
    finally:
        w.close()


@pytest.mark.parametrize("device", DEVICES)
def test_mla_kv_is_stored_once_for_every_tp_rank(store: StoreConfig, device: str) -> None:
    """MLA's latent KV is the same on every TP rank: both ranks key it ``0of1``, only the
    first rank writes, and both load the one copy (what ``engine_layout`` derives for
    ``tensor_parallel_size=2``: tests/connector/test_vllm_keys.py)."""
    layout, objs, pages = "mla", refs("mla", 2), [[0, 1], [2, 3]]
    kv = caches(layout, device, seed=9)
    w0, w1 = worker(store, layout, kv), worker(store, layout, caches(layout, device, seed=10))
    w1.layout = replace(w1.layout, writer=False)  # rank 1 of 2: another rank stores it
    try:
        for w in (w1, w0):
            save(w, kv, StepPlan(saves=[spec("s", objs, pages)], commit_now=True))
        assert w1.stats.data["saved_blocks"] == 0 and w0.stats.data["saved_blocks"] == 2
    finally:
        w0.close()
        w1.close()
    with open_store(store) as st:
        assert len(st.list_keys(engine(layout).keyspace.prefix)) == 2  # one copy, 0of1
    for _ in range(2):  # each rank reads the one copy
        got = caches(layout, device, seed=None)
        r = worker(store, layout, got)
        try:
            assert load(r, got, StepPlan(loads=[spec("r", objs, pages)])) == set()
        finally:
            r.close()
        assert same_pages(got, kv, layout, pages, pages)
