"""The coordinator keeps its index out of Python's cyclic collector
(kvcentric.store.local.heap): once a turn has run, what a collection would scan is what
the last second allocated, not the stored objects; and freezing leaks nothing: objects
evicted, clients gone and leases released are freed (the frozen count follows the live
index, not the objects ever stored)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import OK, open_store
from kvcentric.store.local.client import LocalStore
from kvcentric.store.local.heap import FrozenHeap
from tests.helpers.waiting import wait_until

OBJ = 4096
CHAIN = 64  # objects per prefix chain, each the parent of the next (as engines store)
BATCH = 500


def put_chains(s: LocalStore, tag: str, n: int) -> None:
    """``n`` objects of ``OBJ`` bytes in chains of ``CHAIN``, ``BATCH`` per call."""
    src = np.zeros(OBJ, np.uint8)
    keys = [f"{tag}/{i // CHAIN}/{i % CHAIN}" for i in range(n)]
    parents = [None if i % CHAIN == 0 else keys[i - 1] for i in range(n)]
    for at in range(0, n, BATCH):
        ks = keys[at:at + BATCH]
        codes = s.batch_put_from(ks, [src.ctypes.data] * len(ks), [OBJ] * len(ks),
                                 parents[at:at + BATCH])
        assert codes == [OK] * len(ks), codes[:3]


def config(store_cfg: StoreConfig, **over: Any) -> StoreConfig:
    # 16k objects fit; the shared lookup index (sized by capacity) takes the first 8k
    return store_cfg.with_(capacity_bytes=64 << 20, prefault=False, **over)


def test_stored_objects_leave_the_collected_generations(store_cfg: StoreConfig) -> None:
    with open_store(config(store_cfg)) as s:
        assert isinstance(s, LocalStore)
        base = s.stats()["gc_frozen"]
        assert base > 0  # frozen at start: imports, config, the empty index
        put_chains(s, "a", 8000)
        # within a turn (a second) the entries are frozen and the young generations small
        assert wait_until(lambda: (st := s.stats())["gc_young"] < 2000
                          and st["gc_frozen"] >= base + 8000, 10), s.stats()


def test_freezing_leaks_nothing_under_churn(store_cfg: StoreConfig) -> None:
    """Six rounds of 8000 puts from a fresh client each (48k objects into room for 16k:
    evictions), each round leasing and releasing part of what it wrote and then waiting
    until its entries are frozen (so the evictions of later rounds drop frozen ones). A
    dropped entry, client or lease that stayed in a reference cycle would stay frozen:
    two or more tracked objects per stored object ever, against the bound of three per
    live one."""
    cfg = config(store_cfg)
    with open_store(cfg) as s:
        base = s.stats()["gc_frozen"]
    for r in range(6):
        with open_store(cfg) as c:
            assert isinstance(c, LocalStore)
            put_chains(c, f"churn{r}", 8000)
            keys = [f"churn{r}/0/{i}" for i in range(CHAIN)]
            lease = c.batch_acquire(keys, [OBJ] * len(keys))
            assert len(lease.sizes) == CHAIN
            c.release(lease)
            assert wait_until(lambda: c.stats()["gc_young"] < 2000, 10), c.stats()
    with open_store(cfg) as s:
        st = s.stats()
        assert st["evictions"] > 30000, st
        bound = base + 3 * st["keys"] + 20000
        assert st["gc_frozen"] <= bound, (st, bound)


def test_the_default_policy_is_there_to_compare(store_cfg: StoreConfig) -> None:
    """``gc_freeze: false`` leaves CPython's policy: the entries stay in the collected
    generations (what tests above see is the policy's doing, not the stats')."""
    with open_store(config(store_cfg, gc_freeze=False)) as s:
        assert isinstance(s, LocalStore)
        put_chains(s, "b", 8000)
        st = s.stats()
        assert st["gc_frozen"] == 0 and st["gc_young"] >= 8000, st


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        FrozenHeap(0)
