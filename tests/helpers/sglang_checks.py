"""Checks of the SGLang backend, run by ``sglang_harness`` in a subprocess.

Each ``check_*`` takes the ``store`` section of the extra config first, drives the
backend the way SGLang's cache controller does, and asserts; ``tests/test_sglang_backend.py``
runs them. They live out of the pytest process because importing SGLang changes
process-wide state (environment variables, transformers patches, warning filters)
that the rest of the suite must not inherit.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo

from kvcentric.config import StoreConfig
from kvcentric.store.local import launcher
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
    _eq(backend.batch_set_v1(keys, indices(pool, [1, 2])), [True, True], "set again")
    _eq(backend.batch_exists(keys), 2, "recovered on a fresh coordinator")
    backend.close()


def check_shipped_config(store: dict[str, Any], path: str) -> None:
    """configs/sglang-hicache-kvcentric.json builds a v1 backend (on the test's store)."""
    import json
    from pathlib import Path

    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra = json.loads(Path(path).read_text())
    StoreConfig.from_dict(extra["store"])  # the shipped store section is valid as is
    cfg = storage_config(store, model="shipped")
    cfg.extra_config = {**extra, "store": store}
    backend = StorageBackendFactory.create_backend("dynamic", cfg, None)
    assert backend.settings.v1, "interface_v1 must be on"
    pool = written_pool(False, "page_first", [1])
    backend.register_mem_pool_host(pool)
    _eq(backend.batch_set_v1(page_keys("shipped", 1), indices(pool, [1])), [True], "set")
    backend.close()


# ---- the local store's disk tier (tests/test_sglang_disk.py) ----
def check_disk_settings(store: dict[str, Any]) -> None:
    """The ``store.disk`` section reaches the backend's store config as a ``DiskConfig``;
    a bad one is a ``ValueError`` when SGLang's factory builds the backend."""
    from kvcentric.config import DiskConfig

    backend = create(store, model="disk-settings")
    _eq(backend.settings.store.disk, DiskConfig.from_dict(store["disk"]), "store.disk")
    _eq(backend.settings.store.disk_dir, StoreConfig.from_dict(store).disk_dir, "disk_dir")
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
    flight (writes no faster than the disk, as ``tests/test_store_disk.py`` does).
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
