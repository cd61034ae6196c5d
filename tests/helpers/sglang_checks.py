"""Checks of the SGLang backend, run by ``sglang_harness`` in a subprocess.

Each ``check_*`` takes the ``store`` section of the extra config first, drives the
backend the way SGLang's cache controller does, and asserts;
``tests/connector/test_sglang_backend.py`` runs them. They live out of the pytest
process because importing SGLang changes process-wide state (environment variables,
transformers patches, warning filters) that the rest of the suite must not inherit.
"""

from __future__ import annotations

import ctypes
import time
import uuid
from typing import Any

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo

from kvcentric.config import StoreConfig
from kvcentric.store.local import launcher
from kvcentric.store.local.config import disk_dir
from tests.helpers.sglang_pool import fill_pages, indices, make_pool, page_bytes
from tests.helpers.sglang_setup import create, page_keys, storage_config


def _eq(got: Any, want: Any, what: str) -> None:
    assert got == want, f"{what}: got {got!r}, want {want!r}"


def written_pool(mla: bool, layout: str, pages: list[int], seed: int = 1,
                 **geometry: Any) -> Any:
    pool = make_pool(mla, layout, **geometry)
    fill_pages(pool, pages, seed)
    return pool


def check_factory(store: dict[str, Any]) -> None:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(store, model="org/model"), None)
    assert isinstance(backend, HiCacheStorage), type(backend)
    assert backend.settings.v1 and backend.model_id == "org/model"
    keys = page_keys("early", 2)
    # no host pool yet: nothing is addressable, nothing raises
    _eq(backend.batch_exists(keys), 0, "lookup before the pool")
    _eq(backend.batch_get_v1(keys, torch.arange(16)), [False, False], "load before the pool")
    # hybrid-model side pools (v2) are not stored yet: misses, never an exception
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    backend.register_mem_pool_host(make_pool(False, "page_first"))
    side = [PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=torch.arange(2))]
    _eq(backend.batch_exists_v2(keys, side).kv_hit_pages, 0, "v2 lookup")
    _eq(backend.batch_get_v2(side), {PoolName.MAMBA: [False, False]}, "v2 load")
    _eq(backend.batch_set_v2(side), {PoolName.MAMBA: [False, False]}, "v2 store")
    backend.close()


def check_bad_config(store: dict[str, Any]) -> None:
    for bad, msg in (({**store, "backend": "nope"}, {}), ({**store, "capacityy": 1}, {}),
                     (store, {"model": None})):
        try:
            create(bad, **msg)
        except ValueError:
            continue
        raise AssertionError(f"no ValueError for {bad} {msg}")
    _eq(create(store, model=None, model_id="override").model_id, "override", "model_id")
    from kvcentric.connector.sglang.settings import SGLangSettings

    for extra, why in (({"kvcentric": {"store": store, "modle_id": "x"}}, "modle_id"),
                       ({"store": store}, "under"), ({"kvcentric": []}, "object"),
                       ({"model_id": "m", "kvcentric": {"store": store}}, "under")):
        try:
            SGLangSettings.from_extra_config(extra)
        except ValueError as exc:  # kvcentric's options are strict, SGLang's are not
            assert why in str(exc), (extra, exc)
            continue
        raise AssertionError(f"no ValueError for {extra}")


def write_cases(store: dict[str, Any], cases: dict[str, Any]) -> dict[str, Any]:
    """Store pages 1-4 of a seeded pool per case (``{"mla", "layout", "model"}``);
    returns the keys, the set results and the pages' digests."""
    out = {}
    for cid, case in cases.items():
        pool = written_pool(case["mla"], case["layout"], [1, 2, 3, 4], seed=len(cid))
        backend = create(store, pool, mla=case["mla"], layout=case["layout"],
                         model=case["model"])
        keys = page_keys(cid, 4)
        ok = backend.batch_set_v1(keys, indices(pool, [1, 2, 3, 4]),
                                  HiCacheStorageExtraInfo(prefix_keys=None))
        backend.close()
        out[cid] = {"keys": keys, "set": ok,
                    "digests": [xxhash.xxh3_64_hexdigest(page_bytes(pool, p))
                                for p in (1, 2, 3, 4)]}
    return out


def check_missing(store: dict[str, Any], mla: bool, layout: str) -> None:
    pool = written_pool(mla, layout, [1, 2])
    backend = create(store, pool, mla=mla, layout=layout, model=f"miss-{uuid.uuid4()}")
    keys = page_keys("miss", 3)
    _eq(backend.batch_set_v1(keys[:2], indices(pool, [1, 2])), [True, True], "set")
    _eq(backend.batch_exists(keys), 2, "lookup")
    _eq(backend.batch_exists(keys[2:] + keys[:2]), 0, "lookup of a leading miss")
    fresh = make_pool(mla, layout)
    backend.register_mem_pool_host(fresh)
    got = backend.batch_get_v1([keys[0], keys[2], keys[1]], indices(fresh, [3, 4, 5]))
    _eq(got[:2], [True, False], "load around a miss")
    assert page_bytes(fresh, 3) == page_bytes(pool, 1), "loaded page differs"
    _eq(backend.exists(keys[2]), False, "exists(missing)")
    _eq(backend.get(keys[2], fresh.get_dummy_flat_data_page()), None, "get(missing)")
    buf = torch.zeros(64, dtype=torch.uint8)
    _eq(backend.get(keys[2], buf.data_ptr(), 64), False, "get(missing) by pointer")
    # indices that do not cover the pages: a failed load, counted, not an exception
    _eq(backend.batch_get_v1(keys[:2], indices(fresh, [3])), [False, False], "short indices")
    _eq(backend.get_stats().kvcentric["errors"], 1, "errors counted")
    backend.close()


def check_legacy_shares_objects(store: dict[str, Any], mla: bool, layout: str) -> None:
    pool = written_pool(mla, layout, [1, 2, 3], seed=5)
    backend = create(store, pool, mla=mla, layout=layout, model=f"leg-{uuid.uuid4()}")
    keys = page_keys("legacy", 3)
    # legacy set (SGLang's _generic_page_set: flat data pages), v1 get
    values = [pool.get_data_page(p * pool.page_size) for p in (1, 2)]
    assert backend.batch_set(keys[:2], values), "legacy batch_set"
    fresh = make_pool(mla, layout)
    backend.register_mem_pool_host(fresh)
    _eq(backend.batch_get_v1(keys[:2], indices(fresh, [7, 8])), [True, True], "v1 load")
    assert page_bytes(fresh, 7) == page_bytes(pool, 1), "page 1 differs"
    assert page_bytes(fresh, 8) == page_bytes(pool, 2), "page 2 differs"
    # v1 set, legacy get (SGLang's _generic_page_get: into dummy flat pages)
    backend.register_mem_pool_host(pool)
    _eq(backend.batch_set_v1(keys[2:], indices(pool, [3])), [True], "v1 set")
    dummy = [pool.get_dummy_flat_data_page() for _ in range(3)]
    got = backend.batch_get(keys, dummy)
    assert all(g is d for g, d in zip(got, dummy)), "legacy batch_get missed"
    assert bytes(dummy[2].view(torch.uint8).numpy()) == page_bytes(pool, 3), "page 3 differs"
    assert backend.set(keys[0], values[0]), "set of a stored key"
    backend.close()


def _stored(api: Any, key: str, size: int) -> bytes:
    """The bytes of the object stored under ``key`` (store API, not the backend)."""
    lease = api.batch_acquire([key], [size])
    try:
        assert lease.keys == [key], f"{key} is not stored"
        return ctypes.string_at(lease.ptrs[0], lease.sizes[0])
    finally:
        api.release(lease)


def _store_raw(api: Any, key: str, data: bytes) -> None:
    """Store ``data`` as is under ``key`` (store API: slot, copy, commit)."""
    (slot,) = api.batch_alloc([key], [len(data)])
    assert slot is not None, f"{key} is stored already"
    ctypes.memmove(slot.ptr, data, len(data))
    _eq(api.batch_commit([slot]), [0], f"commit {key}")


def _all_zero(pool: Any, but: tuple[int, ...] = ()) -> bool:
    return all(not any(page_bytes(pool, p)) for p in range(pool.page_num) if p not in but)


def check_integrity(store: dict[str, Any], mla: bool, layout: str) -> None:
    """Objects carry the header of the page they were written for; an object under a
    key whose page, rank, layout or format it was not written for reads as a miss in
    both interfaces, counted as ``integrity_errors``, and no byte of it reaches SGLang's
    host pool or a legacy target."""
    from kvcentric.integrity import HEADER, HEADER_BYTES
    from kvcentric.store import open_store

    model = f"int-{uuid.uuid4()}"
    pool = written_pool(mla, layout, [1, 2], seed=11)
    writer = create(store, pool, mla=mla, layout=layout, model=model, tp_rank=0, tp_size=2)
    keys = page_keys("integrity", 2)
    _eq(writer.batch_set_v1(keys, indices(pool, [1, 2])), [True, True], "set")
    geo = writer.geometry
    size, payload = geo.object_bytes, geo.payload_bytes
    forged = page_keys("forged", 5)
    fkeys, frefs = geo.keys(forged), geo.refs(forged)
    other_layout = "layer_first" if layout == "page_first" else "page_first"
    other = create(store, make_pool(mla, other_layout), mla=mla, layout=other_layout,
                   model=model, tp_rank=0, tp_size=2)
    _eq(other.geometry.payload_bytes, payload, "the other layout's page size")
    with open_store(store) as api:
        obj = [_stored(api, k, size) for k in geo.keys(keys)]
        # the format: a header region naming the page, then the page's bytes
        for o, page, ref in zip(obj, (1, 2), geo.refs(keys)):
            _eq(len(o), size, "object size")
            assert o[HEADER_BYTES:] == page_bytes(pool, page), "payload is not the page"
            _eq(o[:HEADER.size], geo.headers.expected(ref), "header")
            assert not any(o[HEADER.size:HEADER_BYTES]), "header region padding"
        page1 = obj[0][HEADER_BYTES:]
        other_rank = bytearray(geo.headers.expected(frefs[1]))
        other_rank[8:12] = bytes([1, 0, 2, 0])  # tp_rank 1 of 2
        pad = bytes(HEADER_BYTES - HEADER.size)
        _store_raw(api, fkeys[0], obj[0])  # page 1's object under another page's key
        _store_raw(api, fkeys[1], bytes(other_rank) + pad + page1)  # another rank's
        _store_raw(api, fkeys[2], other.geometry.headers.expected(frefs[2]) + pad + page1)
        _store_raw(api, fkeys[3], bytes(HEADER_BYTES) + page1)  # header region zeroed
        _store_raw(api, fkeys[4], page1)  # no header at all (the format before headers)
        if not mla:  # rank 0's page under rank 1's key (MLA: one key space for all ranks)
            rank1 = create(store, make_pool(mla, layout), mla=mla, layout=layout,
                           model=model, tp_rank=1, tp_size=2)
            _store_raw(api, rank1.geometry.keys(keys[:1])[0], obj[0])
    fresh = make_pool(mla, layout)
    reader = create(store, fresh, mla=mla, layout=layout, model=model, tp_rank=0, tp_size=2)

    def counted(same_size: int, headerless: int, what: str) -> None:
        """``integrity_errors`` is ``same_size`` plus ``headerless`` (reads of the short,
        headerless object). Mooncake may refuse to get an object into a buffer of another
        size (TRANSFER_FAIL): then that read is a store-level miss, never leased, and
        uncounted."""
        got = int(reader.get_stats().kvcentric["integrity_errors"])
        mooncake = store.get("backend") == "mooncake"
        ok = same_size <= got <= same_size + headerless if mooncake else \
            got == same_size + headerless
        assert ok, f"{what}: {got} integrity errors, want {same_size} + {headerless}"

    _eq(reader.batch_exists(forged), 5, "lookups find the forged objects (a hint)")
    for i, key in enumerate(forged):
        _eq(reader.batch_get_v1([key], indices(fresh, [3])), [False], f"v1 load of forged {i}")
        counted(min(i + 1, 4), int(i == 4), f"counted forged {i}")
    assert _all_zero(fresh), "a forged object reached the host pool"
    got = reader.batch_get_v1([keys[0], forged[0], keys[1]], indices(fresh, [4, 5, 6]))
    _eq(got, [True, False, False], "v1 load stops at the forged page")
    assert page_bytes(fresh, 4) == page_bytes(pool, 1), "page 1 differs"
    assert _all_zero(fresh, but=(4,)), "bytes past the forged page reached the host pool"
    counted(5, 1, "counted in a batch")
    dummy = fresh.get_dummy_flat_data_page()
    buf = torch.zeros(payload, dtype=torch.uint8)
    for i, key in enumerate(forged):
        _eq(reader.get(key, dummy), None, f"legacy get of forged {i}")
        _eq(reader.get(key, buf.data_ptr(), payload), False, f"pointer get of forged {i}")
    assert not dummy.view(torch.uint8).any() and not buf.any(), "forged bytes copied"
    counted(13, 3, "counted in the legacy interface")
    dummies = [fresh.get_dummy_flat_data_page() for _ in range(3)]
    got = reader.batch_get([forged[0], keys[1], forged[4]], dummies)
    _eq([g is d for g, d in zip(got, dummies)], [False, True, False], "legacy batch_get")
    assert bytes(dummies[1].view(torch.uint8).numpy()) == page_bytes(pool, 2), "page 2 differs"
    assert not dummies[0].view(torch.uint8).any() and not dummies[2].view(torch.uint8).any()
    counted(14, 4, "counted per key")
    _eq(reader.get(keys[0], buf.data_ptr(), payload), True, "pointer get")
    assert bytes(buf.numpy()) == page_bytes(pool, 1), "pointer get differs"
    _eq(reader.get_stats().kvcentric["errors"], 0, "no store error")
    if not mla:
        fresh1 = make_pool(mla, layout)
        rank1.register_mem_pool_host(fresh1)
        _eq(rank1.batch_get_v1(keys[:1], indices(fresh1, [2])), [False], "rank 1 load")
        assert _all_zero(fresh1), "rank 0's page reached rank 1's host pool"
        _eq(rank1.get_stats().kvcentric["integrity_errors"], 1, "rank 1 counted it")
        rank1.close()
    for b in (writer, other, reader):
        b.close()


def check_legacy_pointer_round_trip(store: dict[str, Any], mla: bool, layout: str) -> None:
    """The legacy interface by pointer and size (Mooncake's convention), both ways."""
    pool = written_pool(mla, layout, [1, 2], seed=13)
    backend = create(store, pool, mla=mla, layout=layout, model=f"ptr-{uuid.uuid4()}")
    keys = page_keys("pointer", 2)
    pages = [pool.get_data_page(p * pool.page_size).contiguous() for p in (1, 2)]
    assert backend.batch_set(keys, None, [t.data_ptr() for t in pages],
                             [t.numel() * t.element_size() for t in pages]), "pointer set"
    bufs = [torch.zeros(t.numel() * t.element_size(), dtype=torch.uint8) for t in pages]
    _eq(backend.batch_get(keys, [b.data_ptr() for b in bufs], [b.numel() for b in bufs]),
        [True, True], "pointer get")
    for b, p in zip(bufs, (1, 2)):
        assert bytes(b.numpy()) == page_bytes(pool, p), f"page {p} differs"
    fresh = make_pool(mla, layout)
    backend.register_mem_pool_host(fresh)
    _eq(backend.batch_get_v1(keys, indices(fresh, [5, 6])), [True, True], "v1 load")
    assert page_bytes(fresh, 6) == page_bytes(pool, 2), "v1 load of a pointer-set page"
    _eq(backend.get_stats().kvcentric["integrity_errors"], 0, "no integrity error")
    backend.close()


def check_mla_writer(store: dict[str, Any]) -> None:
    pool = written_pool(True, "page_first", [1, 2])
    model, keys = f"mla-{uuid.uuid4()}", page_keys("mla", 2)
    rank1 = create(store, pool, mla=True, model=model, tp_rank=1, tp_size=2)
    _eq(rank1.batch_set_v1(keys, indices(pool, [1, 2])), [True, True], "rank 1 set (skip)")
    assert rank1.batch_set(keys, [pool.get_data_page(8)] * 2), "rank 1 legacy set (skip)"
    _eq(rank1.batch_exists(keys), 0, "rank 1 wrote nothing")
    _eq(rank1.get_stats().kvcentric["set_skipped"], 4, "skipped pages")
    rank0 = create(store, pool, mla=True, model=model, tp_rank=0, tp_size=2)
    _eq(rank0.batch_set_v1(keys, indices(pool, [1, 2])), [True, True], "rank 0 set")
    fresh = make_pool(True, "page_first")
    rank1.register_mem_pool_host(fresh)
    _eq(rank1.batch_exists(keys), 2, "rank 1 sees rank 0's pages")
    _eq(rank1.batch_get_v1(keys, indices(fresh, [4, 5])), [True, True], "rank 1 load")
    assert page_bytes(fresh, 5) == page_bytes(pool, 2), "page differs"
    # the header names the rank every rank expects (0of1), not the writer's TP rank
    _eq(rank1.get_stats().kvcentric["integrity_errors"], 0, "rank 1 accepts rank 0's headers")
    _eq((rank1.geometry.keyspace.tp_rank, rank1.geometry.keyspace.tp_size), (0, 1), "MLA rank")
    rank0.close()
    rank1.close()


def check_key_separation(store: dict[str, Any]) -> None:
    pool = written_pool(False, "page_first", [1, 2])
    model, keys = f"sep-{uuid.uuid4()}", page_keys("sep", 2)
    writer = create(store, pool, model=model, tp_rank=0, tp_size=2)
    _eq(writer.batch_set_v1(keys, indices(pool, [1, 2])), [True, True], "set")
    readers = {
        "same model, rank, layout": (2, create(store, make_pool(False, "page_first"),
                                               model=model, tp_rank=0, tp_size=2)),
        "other rank": (0, create(store, make_pool(False, "page_first"), model=model,
                                 tp_rank=1, tp_size=2)),
        "other layout": (0, create(store, make_pool(False, "layer_first"), model=model,
                                   layout="layer_first", tp_rank=0, tp_size=2)),
        "other model": (0, create(store, make_pool(False, "page_first"), model=model + "x",
                                  tp_rank=0, tp_size=2)),
    }
    for what, (want, backend) in readers.items():
        _eq(backend.batch_exists(keys), want, what)
        backend.close()
    writer.close()


def check_stats(store: dict[str, Any]) -> None:
    pool = written_pool(False, "layer_first", [1, 2, 3])
    backend = create(store, pool, layout="layer_first", model=f"st-{uuid.uuid4()}")
    keys = page_keys("stats", 3)
    page = backend.geometry.object_bytes
    backend.batch_set_v1(keys, indices(pool, [1, 2, 3]))
    backend.batch_exists(keys + page_keys("stats-miss", 1))
    backend.batch_get_v1(keys[:2], indices(pool, [4, 5]))
    m = backend.get_stats()
    _eq((m.backup_pgs, m.prefetch_pgs), ([3], [2]), "pages per call")
    assert len(m.backup_bandwidth) == 1 and m.prefetch_bandwidth[0] > 0, m
    c = m.kvcentric
    _eq((c["set_pages"], c["set_ok"], c["set_bytes"]), (3, 3, 3 * page), "set counters")
    _eq((c["exists_pages"], c["exists_hits"]), (4, 3), "lookup counters")
    _eq((c["get_pages"], c["get_hits"], c["get_bytes"]), (2, 2, 2 * page), "get counters")
    again = backend.get_stats()
    _eq((again.backup_pgs, again.kvcentric), ([], c), "lists drained, counters kept")
    quiet = create(store, pool, layout="layer_first", model=f"st-{uuid.uuid4()}",
                   metrics=False)
    quiet.batch_set_v1(keys, indices(pool, [1, 2, 3]))
    m = quiet.get_stats()
    _eq((m.backup_pgs, m.kvcentric["set_ok"]), ([], 3), "metrics off: counters only")
    backend.close()
    quiet.close()


def check_clear(store: dict[str, Any]) -> None:
    pool = written_pool(True, "layer_first", [1, 2])
    keys, tag = page_keys("clear", 2), uuid.uuid4().hex
    mine = create(store, pool, mla=True, layout="layer_first", model=f"clear-a-{tag}")
    other = create(store, pool, mla=True, layout="layer_first", model=f"clear-b-{tag}")
    for b in (mine, other):
        _eq(b.batch_set_v1(keys, indices(pool, [1, 2])), [True, True], "set")
    _eq(mine.clear(), True, "clear")
    _eq((mine.batch_exists(keys), other.batch_exists(keys)), (0, 2), "after clear")
    _eq(mine.batch_set_v1(keys, indices(pool, [1, 2])), [True, True], "set after clear")
    mine.close()
    other.close()


def check_store_never_started(store: dict[str, Any]) -> None:
    pool = written_pool(False, "page_first", [1])
    backend = create({**store, "autostart": False}, pool, model="down")
    keys = page_keys("down", 1)
    _eq(backend.batch_set_v1(keys, indices(pool, [1])), [False], "set")
    _eq(backend.batch_exists(keys), 0, "lookup")
    _eq(backend.batch_get_v1(keys, indices(pool, [2])), [False], "load")
    _eq(backend.get(keys[0], pool.get_dummy_flat_data_page()), None, "legacy get")
    _eq(backend.set(keys[0], pool.get_data_page(8)), False, "legacy set")
    _eq(backend.clear(), False, "clear")
    assert backend.get_stats().kvcentric["errors"] == 0, "nothing reached a store"
    backend.close()


def check_store_stops_midway(store: dict[str, Any]) -> None:
    pool = written_pool(True, "layer_first", [1, 2])
    backend = create(store, pool, mla=True, layout="layer_first", model="gone")
    keys = page_keys("gone", 2)
    _eq(backend.batch_set_v1(keys, indices(pool, [1, 2])), [True, True], "set")
    launcher.stop(StoreConfig.from_dict(store))  # autostart brings up an empty one later
    _eq(backend.batch_exists(keys), 0, "lookup right after the stop")
    _eq(backend.batch_get_v1(keys, indices(pool, [3, 4])), [False, False], "load")
    # the client reconnects in the background once its breaker's interval has passed
    # (never inline in a set); autostart brings up an empty coordinator meanwhile
    deadline = time.monotonic() + 20
    while backend.batch_set_v1(keys, indices(pool, [1, 2])) != [True, True]:
        assert time.monotonic() < deadline, "set again: the store never came back"
        time.sleep(0.1)
    _eq(backend.batch_exists(keys), 2, "recovered on a fresh coordinator")
    backend.close()


def check_shipped_config(store: dict[str, Any], path: str) -> None:
    """configs/sglang-hicache-kvcentric.json builds a v1 backend (on the test's store)."""
    import json
    from pathlib import Path

    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra = json.loads(Path(path).read_text())
    StoreConfig.from_dict(extra["kvcentric"]["store"])  # the shipped store is valid as is
    cfg = storage_config(store, model="shipped")
    cfg.extra_config = {**extra, "kvcentric": {**extra["kvcentric"], "store": store}}
    backend = StorageBackendFactory.create_backend("dynamic", cfg, None)
    assert backend.settings.v1, "interface_v1 must be on"
    pool = written_pool(False, "page_first", [1])
    backend.register_mem_pool_host(pool)
    _eq(backend.batch_set_v1(page_keys("shipped", 1), indices(pool, [1])), [True], "set")
    backend.close()


# ---- the local store's disk tier (tests/connector/test_sglang_disk.py) ----
def check_disk_settings(store: dict[str, Any]) -> None:
    """The ``store.disk`` section reaches the backend's store config as a ``DiskConfig``;
    a bad one is a ``ValueError`` when SGLang's factory builds the backend."""
    from kvcentric.store.local.config import DiskConfig

    backend = create(store, model="disk-settings")
    _eq(backend.settings.store.local.disk, DiskConfig.from_dict(store["disk"]), "store.disk")
    _eq(disk_dir(backend.settings.store), disk_dir(StoreConfig.from_dict(store)), "disk_dir")
    backend.close()
    disk = store["disk"]
    for bad in ({**disk, "bogus": 1}, {"path": disk["path"]}, {**disk, "capacity": 0},
                {**disk, "high_watermark": 1.5}, {**disk, "capacity": "1000000tb"}):
        try:
            create({**store, "disk": bad})
        except ValueError:
            continue
        raise AssertionError(f"no ValueError for store.disk {bad}")


def write_past_dram(store: dict[str, Any], cases: dict[str, Any],
                    filler: dict[str, Any]) -> dict[str, Any]:
    """Store pages 1-4 per case (``{"mla", "layout", "model", "pool"}``; one prefix chain
    each, as ``write_cases``), then ``filler["batches"]`` chains of 8 MHA ``page_first``
    pages (geometry ``filler["pool"]``) of another model, so the cases' pages leave DRAM
    for the disk tier. After every batch it waits until the store has no demotion in
    flight (writes no faster than the disk, as ``tests/store/test_store_disk.py`` does).
    Returns per case the keys, set results and page digests, and the store's stats."""
    from kvcentric.store import open_store
    from tests.helpers.waiting import wait_until

    out: dict[str, Any] = {}
    with open_store(store) as probe:
        def settle() -> None:
            assert wait_until(lambda: probe.stats()["demoting"] == 0, 60), probe.stats()

        for cid, case in cases.items():
            pool = written_pool(case["mla"], case["layout"], [1, 2, 3, 4], seed=len(cid),
                                **case.get("pool", {}))
            backend = create(store, pool, mla=case["mla"], layout=case["layout"],
                             model=case["model"])
            keys = page_keys(f"disk-{cid}", 4)
            ok = backend.batch_set_v1(keys, indices(pool, [1, 2, 3, 4]),
                                      HiCacheStorageExtraInfo(prefix_keys=None))
            backend.close()
            settle()
            out[cid] = {"keys": keys, "set": ok, "object_bytes": backend.geometry.object_bytes,
                        "digests": [xxhash.xxh3_64_hexdigest(page_bytes(pool, p))
                                    for p in (1, 2, 3, 4)]}
        pool = written_pool(False, "page_first", list(range(8)), seed=7, **filler["pool"])
        backend = create(store, pool, model="disk-filler")
        filled = 0
        for b in range(filler["batches"]):
            ok = backend.batch_set_v1(page_keys(f"filler/{b}", 8), indices(pool, list(range(8))),
                                      HiCacheStorageExtraInfo(prefix_keys=None))
            _eq(ok, [True] * 8, f"filler batch {b}")
            filled += 8 * backend.geometry.object_bytes
            settle()
        backend.close()
        return {"cases": out, "filler_bytes": filled, "stats": probe.stats()}
