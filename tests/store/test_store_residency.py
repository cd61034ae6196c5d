"""``KVStore.batch_residency``: the leading run and which of its objects are on disk only.

The local store with a disk tier answers from the coordinator (exact, one round trip);
without one nothing is on disk and the answer is ``batch_exists``'s (the shared index, no
round trip); other backends inherit the default.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import OK, KVStore, Residency, open_store
from kvcentric.store.local import launcher
from kvcentric.store.local.client import LocalStore
from kvcentric.store.local.config import DiskConfig
from tests.helpers.waiting import wait_until
from tests.store.store_contract import get, put

MB = 1 << 20


@pytest.fixture
def disk_store(store_cfg: StoreConfig, tmp_path: Path) -> Iterator[LocalStore]:
    """16 MiB of DRAM over a 256 MiB disk tier (as in test_store_disk.py)."""
    cfg = store_cfg.with_(capacity_bytes=16 * MB, disk=DiskConfig(tmp_path / "disk", 256 * MB))
    s = open_store(cfg)
    assert isinstance(s, LocalStore)
    yield s
    s.close()
    launcher.stop(cfg)


def _settled(store: LocalStore) -> bool:
    st = store.stats()
    return st["demoting"] == 0 and st["disk_recovering"] == 0


def _chain(store: LocalStore, prefix: str, n: int, batch: int = 8) -> list[str]:
    """Put one prefix chain of ``n`` objects (64-256 KiB each), waiting for the demotions
    after each batch so every object reaches the disk before DRAM drops it."""
    keys = [f"{prefix}/{i}" for i in range(n)]
    for i in range(0, n, batch):
        b = keys[i:i + batch]
        assert put(store, b, [keys[i - 1] if i else None, *b[:-1]]) == [OK] * len(b)
        assert wait_until(lambda: store.stats()["demoting"] == 0, 20.0)
    assert wait_until(lambda: _settled(store), 20.0)
    return keys


def _disk_only_total(store: LocalStore) -> int:
    st = store.stats()
    return int(st["keys"] - st["dram_objects"])


def test_residency_checks_its_values() -> None:
    assert Residency(6, (0, 2, 5)).on_disk == 3 and Residency(4).on_disk == 0
    for bad in ((3, (3,)), (-1, ()), (1, (0, 0))):
        with pytest.raises(ValueError, match="residency"):
            Residency(*bad)  # type: ignore[arg-type]


def test_disk_only_objects_are_counted_exactly_and_promotion_lowers_them(
        disk_store: LocalStore) -> None:
    s = disk_store
    keys = _chain(s, "rs", 256)  # ~40 MiB through 16 MiB of DRAM
    pad = _chain(s, "pad", 48)  # the newest objects: they hold DRAM until removed
    lookups = s.stats()["lookups"]
    res = s.batch_residency(keys)
    assert s.stats()["lookups"] == lookups + 1  # one round trip, to the coordinator
    assert res.run == s.batch_exists(keys) == 256
    assert 0 in res.disk_only  # the cold head of the chain left DRAM
    assert res.on_disk + s.batch_residency(pad).on_disk == _disk_only_total(s)
    for k in pad:  # free DRAM so the reads below promote without evicting anything else
        assert s.remove(k) == OK
    assert res.on_disk == _disk_only_total(s)
    cold = [keys[i] for i in res.disk_only[:4]]
    before = s.stats()
    assert all(b is not None for b in get(s, cold))  # read from disk, promoted at settle
    assert wait_until(lambda: s.stats()["promotions"] >= before["promotions"] + 4, 10.0)
    after = s.batch_residency(keys)
    evicted = s.stats()["dram_evictions"] - before["dram_evictions"]
    assert after.run == 256 and not set(res.disk_only[:4]) & set(after.disk_only)
    assert after.on_disk == res.on_disk - 4 + evicted == _disk_only_total(s)
    # a broken chain stops the run; what is on disk before the break is still reported
    assert s.remove(keys[100]) == OK
    broken = s.batch_residency(keys)
    assert broken.run == 100 == s.batch_exists(keys)
    assert broken.disk_only == tuple(i for i in after.disk_only if i < 100)
    assert s.batch_residency(keys[101:]).run == 155 and s.batch_residency([]) == Residency(0)


def test_without_a_disk_tier_nothing_is_on_disk_and_no_round_trip(
        store_cfg: StoreConfig) -> None:
    with open_store(store_cfg) as s:
        assert isinstance(s, LocalStore)
        keys = [f"nd/{i}" for i in range(8)]
        assert put(s, keys, [None, *keys[:-1]]) == [OK] * 8
        lookups = s.stats()["lookups"]
        assert s.batch_residency(keys) == Residency(8)
        assert s.batch_residency([*keys[:5], "nope", *keys[5:]]) == Residency(5)
        assert s.stats()["lookups"] == lookups  # answered from the shared index
        assert s.remove(keys[3]) == OK
        assert s.batch_residency(keys) == Residency(3)  # a broken chain stops the run
        assert KVStore.batch_residency(s, keys) == Residency(3)  # the ABC's default

