"""The KVStore contract (tests/store/store_contract.py) on the mooncake backend, against a
real ``mooncake_master`` in a private network namespace, with checksums on (the default)
and off; and scatter-gather puts and gets. No wall-clock bound here: these run in make
test's parallel pass. Faults and the service commands: tests/store/test_store_mooncake.py
(serial)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvcentric.store import OK, KVStore, open_store
from kvcentric.testing.netns import unavailable_reason
from tests.helpers.mooncake_cluster import MooncakeCluster, module_cluster_fixtures
from tests.store.store_contract import StoreContract

pytest.importorskip("mooncake.store", reason="the Mooncake wheel is not installed")
_NO_NETNS = unavailable_reason()
pytestmark = [pytest.mark.mooncake,
              pytest.mark.skipif(_NO_NETNS is not None, reason=f"no netns: {_NO_NETNS}")]


mc, _in_netns = module_cluster_fixtures("mooncake-contract")


# ---- the contract: this client contributes the only segment, others are pure clients ----
@pytest.fixture
def store(mc: MooncakeCluster) -> Iterator[KVStore]:
    s = open_store(mc.store_config(global_segment_size="32mb"))
    s.clear()  # type: ignore[attr-defined]
    yield s
    s.close()


@pytest.fixture
def store_config(mc: MooncakeCluster) -> dict[str, Any]:
    return mc.store_config()


class TestMooncakeContract(StoreContract):
    """The contract with Mooncake's defaults: ``verify_checksums`` on (a trailer on every
    object: Mooncake's network is neither authenticated nor protected)."""

    def test_checksums_are_on_by_default(self, store: KVStore) -> None:
        from kvcentric.config import StoreConfig
        assert store.cfg.verify_checksums is True  # type: ignore[attr-defined]
        assert StoreConfig(backend="mooncake").verify_checksums is True
        assert StoreConfig().verify_checksums is False  # the local store's default
        assert StoreConfig.from_dict({"backend": "mooncake",
                                      "verify_checksums": False}).verify_checksums is False


class TestMooncakeContractWithoutChecksums(StoreContract):
    """The whole contract again with ``verify_checksums: false`` (a trusted network: no
    trailer, and streamed reads get byte ranges)."""

    @pytest.fixture
    def store(self, mc: MooncakeCluster) -> Iterator[KVStore]:
        s = open_store(mc.store_config(global_segment_size="32mb") | {"verify_checksums": False})
        s.clear()  # type: ignore[attr-defined]
        yield s
        s.close()

    @pytest.fixture
    def store_config(self, mc: MooncakeCluster) -> dict[str, Any]:
        return mc.store_config() | {"verify_checksums": False}


def test_scatter_gather_puts_and_gets(store: KVStore) -> None:
    """Objects gathered from several buffers (pages) read back whole, and vice versa."""
    from kvcentric.store.mooncake.store import MooncakeStore
    assert isinstance(store, MooncakeStore)
    pages = [np.full(4096, i, np.uint8) for i in range(6)]
    ptrs, sizes = [p.ctypes.data for p in pages], [p.nbytes for p in pages]
    assert store.batch_put_from_multi(["sg/0", "sg/1"], [ptrs[:3], ptrs[3:]],
                                      [sizes[:3], sizes[3:]]) == [OK, OK]
    assert store.batch_put_from_multi(["sg/0"], [ptrs[:3]], [sizes[:3]]) == [OK]  # skipped
    whole = np.zeros(3 * 4096, np.uint8)
    assert store.batch_get_into(["sg/1"], [whole.ctypes.data], [whole.nbytes]) == [3 * 4096]
    assert np.array_equal(whole, np.repeat(np.arange(3, 6, dtype=np.uint8), 4096))
    out = [np.zeros(4096, np.uint8) for _ in range(3)]
    got = store.batch_get_into_multi(["sg/0", "nope"], [[o.ctypes.data for o in out]] * 2,
                                     [[4096] * 3] * 2)
    assert got[0] == 3 * 4096 and got[1] < 0
    assert all(np.array_equal(o, pages[i]) for i, o in enumerate(out))
    assert store.stats()["skipped_puts"] == 1
    # more buffers than one Mooncake call takes: split into several calls, same result
    big = np.random.default_rng(0).integers(0, 255, 70 * 16 * 1024, dtype=np.uint8)
    ptr_lists = [[big.ctypes.data + (16 * i + j) * 1024 for j in range(16)] for i in range(70)]
    keys = [f"sgbig/{i}" for i in range(70)]
    assert store.batch_put_from_multi(keys, ptr_lists, [[1024] * 16] * 70) == [OK] * 70
    back = np.zeros_like(big)
    back_lists = [[back.ctypes.data + (16 * i + j) * 1024 for j in range(16)]
                  for i in range(70)]
    assert store.batch_get_into_multi(keys, back_lists, [[1024] * 16] * 70) == [16384] * 70
    assert np.array_equal(back, big)


# ---- processes and nodes ----
