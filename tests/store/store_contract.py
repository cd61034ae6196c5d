"""The KVStore contract, as tests any backend's test module can inherit.

A subclass provides the ``store`` fixture (a fresh, empty store of at least 16 MiB) and
``store_config`` (the dict a second process passes to ``open_store``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kvcentric.store import ERR_NOT_FOUND, OK, KVStore
from tests.helpers.payload import payload, size_of

WORKER = Path(__file__).parents[1] / "helpers" / "store_worker.py"


def run_worker(cfg: dict[str, Any], mode: str, *args: str, timeout: float = 120) -> Any:
    out = subprocess.run([sys.executable, str(WORKER), json.dumps(cfg), mode, *args],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def put(store: KVStore, keys: list[str], parents: list[str | None] | None = None) -> list[int]:
    data = [payload(k, size_of(k)) for k in keys]
    return store.batch_put_from(keys, [d.ctypes.data for d in data], [d.nbytes for d in data],
                                parents)


def get(store: KVStore, keys: list[str]) -> list[np.ndarray | None]:
    bufs = [np.zeros(size_of(k), np.uint8) for k in keys]
    got = store.batch_get_into(keys, [b.ctypes.data for b in bufs], [b.nbytes for b in bufs])
    return [b if g == b.nbytes else None for b, g in zip(bufs, got)]


class StoreContract:
    """Tests of the semantics in kvcentric.store.base, backend-independent."""

    def test_put_get_round_trip(self, store: KVStore) -> None:
        keys = [f"rt/{i}" for i in range(5)]
        assert put(store, keys) == [OK] * 5
        for k, b in zip(keys, get(store, keys)):
            assert b is not None and np.array_equal(b, payload(k, b.nbytes))

    def test_exists_is_a_leading_run(self, store: KVStore) -> None:
        put(store, ["e/0", "e/1", "e/3"])
        assert store.batch_exists(["e/0", "e/1", "e/2", "e/3"]) == 2
        assert store.batch_exists(["e/2", "e/0"]) == 0
        assert store.batch_exists([]) == 0

    def test_residency_nowait_is_batch_residency_or_none(self, store: KVStore) -> None:
        put(store, ["n/0", "n/1", "n/3"])
        for keys in (["n/0", "n/1", "n/2", "n/3"], ["n/2", "n/0"], ["n/0"]):
            got = store.residency_nowait(keys)
            assert got is None or got == store.batch_residency(keys)

    def test_missing_get_is_an_error_not_data(self, store: KVStore) -> None:
        buf = np.zeros(4096, np.uint8)
        (code,) = store.batch_get_into(["nope"], [buf.ctypes.data], [buf.nbytes])
        assert code == ERR_NOT_FOUND and not buf.any()

    def test_put_existing_key_is_ok(self, store: KVStore) -> None:
        assert put(store, ["dup"]) == [OK]
        assert put(store, ["dup"]) == [OK]
        assert store.stats()["keys"] == 1

    def test_remove(self, store: KVStore) -> None:
        put(store, ["r"])
        assert store.remove("r") == OK
        assert store.batch_exists(["r"]) == 0
        assert store.remove("r") < 0

    def test_in_place_write_invisible_until_commit(self, store: KVStore) -> None:
        (slot,) = store.batch_alloc(["w"], [size_of("w")])
        assert slot is not None
        data = payload("w", slot.size)
        import ctypes
        ctypes.memmove(slot.ptr, data.ctypes.data, slot.size)
        assert store.batch_exists(["w"]) == 0
        assert store.batch_commit([slot]) == [OK]
        assert store.batch_exists(["w"]) == 1
        (b,) = get(store, ["w"])
        assert b is not None and np.array_equal(b, data)
        (slot2,) = store.batch_alloc(["w2"], [100])
        assert slot2 is not None
        store.batch_abort([slot2])
        assert store.batch_exists(["w2"]) == 0

    def test_in_place_read_lease(self, store: KVStore) -> None:
        put(store, ["l/0", "l/1"])
        lease = store.batch_acquire(["l/0", "l/1", "l/2"], [size_of(f"l/{i}") for i in range(3)])
        try:
            assert lease.keys == ["l/0", "l/1"]
            import ctypes
            for k, p, s in zip(lease.keys, lease.ptrs, lease.sizes):
                view = np.ctypeslib.as_array((ctypes.c_uint8 * s).from_address(p))
                assert np.array_equal(view, payload(k, s))
        finally:
            store.release(lease)

    def test_streamed_read_lease(self, store: KVStore) -> None:
        """Bytes of a streamed lease are right once their ranges are fetched, whatever the
        backend's eagerness; the lease is the leading run of present keys."""
        size = 96 << 10
        keys = [f"st/{i}" for i in range(3)]
        data = [payload(k, size) for k in keys[:2]]
        assert store.batch_put_from(keys[:2], [d.ctypes.data for d in data],
                                    [size, size]) == [OK, OK]
        lease = store.batch_acquire_streamed(keys, [size] * 3)
        try:
            assert lease.keys == keys[:2]
            for off, n in ((0, 4096), (4096, 60 << 10), (64 << 10, 32 << 10)):  # ragged
                store.fetch_range(lease, off, n)
            import ctypes
            for d, p in zip(data, lease.ptrs):
                view = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(p))
                assert np.array_equal(view, d)
        finally:
            store.release(lease)
        assert store.batch_acquire_streamed(["st/none"], [size]).keys == []

    def test_stats_and_health(self, store: KVStore) -> None:
        put(store, ["s/0", "s/1"])
        get(store, ["s/0", "zz"])
        st = store.stats()
        for field in ("used_bytes", "capacity_bytes", "keys", "hits", "misses", "puts", "gets",
                      "evictions"):
            assert field in st
        assert st["keys"] == 2 and st["puts"] == 2 and st["hits"] >= 1
        assert store.health_check()

    def test_capacity_is_a_hard_bound(self, store: KVStore) -> None:
        cap = store.stats()["capacity_bytes"]
        keys = [f"cap/{i}" for i in range(3 * cap // (160 << 10))]
        for i in range(0, len(keys), 16):
            batch = keys[i:i + 16]
            codes = put(store, batch, [None, *batch[:-1]])
            assert all(c == OK for c in codes)
            assert store.stats()["used_bytes"] <= cap
        st = store.stats()
        assert st["evictions"] > 0 and st["used_bytes"] <= cap
        # the newest objects survive
        assert store.batch_exists(keys[-4:]) == 4

    def test_another_process_reads_and_writes(self, store: KVStore,
                                              store_config: dict[str, Any]) -> None:
        put(store, ["x/0", "x/1"])
        assert run_worker(store_config, "get", "x/0", "x/1") == {"got": 2, "bad": 0}
        assert run_worker(store_config, "put", "y/0") == [OK]
        (b,) = get(store, ["y/0"])
        assert b is not None and np.array_equal(b, payload("y/0", b.nbytes))
