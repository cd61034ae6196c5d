"""The disk tier end to end: a prefix evicted from DRAM to disk is loaded, layer by layer
from its files, by a fresh vLLM CPU instance (docs/store.md §Disk tier)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import OK, open_store
from kvcentric.store.local import launcher
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import VllmServer, connector_config
from tests.helpers.e2e_store import e2e_store
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.vllm
STORED_BLOCK = 128  # the default stored block on CPU: one 128-token page
OBJECT = 512 << 10  # the tiny model's object: 512 KiB per 128-token block


def _wait(pred: Any, timeout: float = 30.0) -> bool:
    return wait_until(pred, timeout, 0.1)


@pytest.fixture
def disk_store(runtime_dir: Path, tmp_path: Path) -> Iterator[dict[str, Any]]:
    # high_watermark 0 (the default): every object is written back at once, so once a
    # pair's demotions are done the next reserves find clean objects to evict. At 0.5 up to
    # 8 MiB stayed dirty, a full DRAM then held reserves back for demotion (put_wait_s,
    # 25 ms) and a slow disk got a filler put refused: a failed fresh-clone run
    cfg = e2e_store("vllm-disk", "16mb", runtime_dir,
                    disk={"path": str(tmp_path / "disk"), "capacity": "256mb"})
    yield cfg
    launcher.stop(StoreConfig.from_dict(cfg))


def _push_to_disk(cfg: dict[str, Any], n: int) -> dict[str, int]:
    """Write ``n`` filler objects through a 16 MiB DRAM, two at a time, letting each pair's
    demotions finish (nothing dirty, nothing being written), so everything older is on disk
    only once DRAM evicts it; returns the store's stats."""
    filler = np.random.default_rng(0).integers(0, 256, OBJECT, np.uint8)
    with open_store(cfg) as store:
        for i in range(0, n, 2):
            keys = [f"filler/{j}" for j in range(i, i + 2)]
            codes = store.batch_put_from(keys, [filler.ctypes.data] * 2, [OBJECT] * 2)
            assert codes == [OK] * 2
            assert _wait(lambda: (st := store.stats())["demoting"] == 0
                         and st["dirty_bytes"] == 0)
        return store.stats()


def test_prefix_evicted_to_disk_is_loaded_by_a_fresh_instance(
        disk_store: dict[str, Any], tmp_path: Path) -> None:
    model = str(build_model("tiny", Path.cwd() / ".models" / "tiny"))
    rnd = random.Random(15)
    p = [rnd.randrange(4, 4000) for _ in range(8 * STORED_BLOCK + 1)]  # 8 full blocks
    writer = VllmServer(model, log_path=tmp_path / "writer.log",
                        kv_transfer=connector_config(disk_store))
    fresh = VllmServer(model, log_path=tmp_path / "fresh.log",
                       kv_transfer=connector_config(disk_store, role="kv_consumer"))
    try:
        writer.start()
        fresh.start()
        writer.wait_ready()
        fresh.wait_ready()
        want = writer.tokens(p)  # a miss: computed, and its 8 blocks saved
        before = _push_to_disk(disk_store, 48)
        assert before["dropped_undemoted"] == 0 and before["demotions"] >= 8, before
        assert fresh.tokens(p) == want
        m = fresh.metrics()
        assert m["vllm:external_prefix_cache_hits_total"] == 8 * STORED_BLOCK
        assert m.get("vllm:kvcentric_load_errors_total", 0.0) == 0
        with open_store(disk_store) as store:
            after = store.stats()
        # the blocks came from their files, not from DRAM, and were promoted on the way
        assert after["disk_hits"] - before["disk_hits"] >= 8, after
        assert after["promotions"] - before["promotions"] >= 1
        assert after["disk_corrupt"] == 0 and after["disk_missing"] == 0
    finally:
        writer.stop()
        fresh.stop()
