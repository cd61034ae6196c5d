"""Soft pins for the P/D handoff, on the real local store (coordinator process, shared
arena): blocks a prefill commits pinned survive constant eviction pressure until the
decode reads them or the pin's deadline passes; a store holding only pinned or leased
objects refuses new puts rather than evicting them; with the disk tier, a pinned object
may leave DRAM but stays readable from disk. The connector's side (a ``kv_producer``
worker commits with ``handoff_pin_s``) is in test_cuda_path / the vLLM P/D tests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import ERR_NO_SPACE, OK, KVStore, open_store
from kvcentric.store.local import launcher
from kvcentric.store.local.config import DiskConfig
from tests.helpers.waiting import wait_until

MB = 1 << 20
OBJ = 4 * MB  # the store (64 MiB) holds 16


def commit(store: KVStore, keys: list[str], pin_s: float = 0.0, fill: int = 7) -> list[int]:
    slots = store.batch_alloc(keys, [OBJ] * len(keys), [None, *keys[:-1]])
    live = [s for s in slots if s is not None]
    for s in live:
        np.frombuffer((np.ctypeslib.as_ctypes_type(np.uint8) * s.size).from_address(s.ptr),
                      np.uint8)[:] = fill
    codes = store.batch_commit(live, pin_s)
    return [c for c in codes] + [ERR_NO_SPACE] * (len(keys) - len(live))


def flood(store: KVStore, tag: str, n: int = 40) -> int:
    """Put ``n`` unrelated unpinned objects (2.5x the store): constant eviction."""
    ok = 0
    for i in range(n):
        ok += commit(store, [f"{tag}-{i}"]) == [OK]
    return ok


def read(store: KVStore, keys: list[str]) -> int:
    lease = store.batch_acquire(keys, [OBJ] * len(keys))
    n = len(lease.keys)
    store.release(lease)
    return n


@pytest.fixture
def store(store_cfg: StoreConfig) -> Iterator[KVStore]:
    with open_store(store_cfg) as s:
        yield s


def test_pinned_handoff_survives_eviction_until_read(store: KVStore) -> None:
    chain = [f"handoff-{i}" for i in range(4)]
    assert commit(store, chain, pin_s=60) == [OK] * 4
    assert flood(store, "a") >= 30  # the other 12 slots keep turning over
    assert store.batch_exists(chain) == 4  # nothing of the handoff was evicted
    assert read(store, chain) == 4  # the decode loads it: the pins end here
    flood(store, "b")
    assert store.batch_exists(chain) == 0  # now ordinary LRU objects, long evicted
    assert store.stats()["pinned"] >= 4


def test_a_pin_ends_at_its_deadline(store: KVStore) -> None:
    """A pin holds through eviction until its deadline, and not after. The pin is long
    against a flood timed here (so the first check falls inside it, whatever the load),
    and the second flood starts only once the deadline has passed on the clock the
    coordinator uses (``time.monotonic``, one per host)."""
    t0 = time.monotonic()
    flood(store, "warm", 20)
    pin_s = max(1.0, 10 * (time.monotonic() - t0))
    t0 = time.monotonic()  # the coordinator stamps the pin between t0 and t1
    assert commit(store, ["short"], pin_s=pin_s) == [OK]
    t1 = time.monotonic()
    flood(store, "a", 20)
    assert store.batch_exists(["short"]) == 1
    assert time.monotonic() < t0 + pin_s, "the check came after the pin's deadline"
    assert wait_until(lambda: time.monotonic() > t1 + pin_s, pin_s + 10)  # it has passed
    flood(store, "b", 20)
    assert store.batch_exists(["short"]) == 0  # the decode never came: it is a cache again


def test_a_store_of_pinned_objects_refuses_puts(store_cfg: StoreConfig) -> None:
    # one client may pin the whole store only when its cap says so (the default cap is
    # half the capacity: tests/test_store_hostile_peers.py)
    with open_store(store_cfg.with_(max_pinned_bytes=store_cfg.local.capacity_bytes)) as store:
        pinned = [f"p{i}" for i in range(16)]
        assert commit(store, pinned, pin_s=60) == [OK] * 16
        assert commit(store, ["newcomer"]) == [ERR_NO_SPACE]  # refused, nothing evicted
        assert store.batch_exists(pinned) == 16


def test_pins_are_bounded(store: KVStore) -> None:
    slots = [s for s in store.batch_alloc(["x"], [OBJ]) if s is not None]
    with pytest.raises(Exception, match="pin"):
        store._link.call("commit", ["x"], [None], 1e9)  # type: ignore[attr-defined]
    store.batch_abort(slots)


def test_with_a_disk_tier_a_pinned_object_stays_readable(store_cfg: StoreConfig,
                                                         tmp_path: Path) -> None:
    cfg = store_cfg.with_(name=store_cfg.name + "d", disk=DiskConfig(tmp_path / "disk", 512 * MB))
    try:
        _pinned_survives_with_disk(cfg)
    finally:
        launcher.stop(cfg)  # its own name: the store_cfg fixture stops only the other one


def _pinned_survives_with_disk(cfg: StoreConfig) -> None:
    with open_store(cfg) as s:
        chain = [f"h{i}" for i in range(4)]
        assert commit(s, chain, pin_s=60, fill=9) == [OK] * 4
        flood(s, "a")
        assert s.batch_exists(chain) == 4
        lease = s.batch_acquire(chain, [OBJ] * 4)
        try:
            assert len(lease.keys) == 4
            for ptr in lease.ptrs:
                s.fetch_range(lease, 0, OBJ)
                got = np.frombuffer((np.ctypeslib.as_ctypes_type(np.uint8) * OBJ)
                                    .from_address(ptr), np.uint8)
                assert (got == 9).all()
        finally:
            s.release(lease)
