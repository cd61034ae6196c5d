"""The SGLang HiCache backend on a local store with a disk (SSD) tier, configured through
the same ``store`` section every connector takes (docs/store.md §Disk tier).

SGLang's own ``StorageBackendFactory`` builds the backend (in subprocesses, see
``tests/helpers/sglang_harness.py``) on a store of 1 MiB of DRAM and a disk tier in a
temporary directory. Pages of the four layouts are stored, then ~4.5 MiB of other pages
push them out of DRAM onto disk only; a second, fresh process finds them
(``batch_exists`` / ``exists``) and loads them, byte for byte, from their files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcentric.config import StoreConfig, parse_size
from kvcentric.store import open_store
from kvcentric.store.local import launcher
from kvcentric.store.local.config import disk_dir
from tests.helpers.e2e_store import TEST_HOT_TIMEOUT_S
from tests.helpers.sglang_harness import Harness
from tests.helpers.waiting import wait_until

WORKER = Path(__file__).parents[1] / "helpers" / "sglang_worker.py"
CASES = [(False, "page_first"), (False, "layer_first"), (True, "page_first"),
         (True, "layer_first")]
CASE_IDS = [f"{'mla' if m else 'mha'}-{lay}" for m, lay in CASES]
DRAM = "1mb"
GEOMETRY = {"page_size": 64}  # pages of 24 KiB (MHA) and 12 KiB (MLA): ~40-80 fit in DRAM
FILLER_BATCHES = 24  # 24 chains of 8 MHA pages: 4.5 MiB through the 1 MiB DRAM
PAGES = 4  # stored per case, read back per case
TIER_COUNTERS = ("disk_hits", "dram_hits", "promotions", "disk_read_bytes", "disk_corrupt",
                 "disk_missing")


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    """One subprocess with SGLang imported, shared by the module's tests."""
    h = Harness(tmp_path_factory.mktemp("sglang-disk") / "harness.log")
    yield h
    h.close()


@pytest.fixture(scope="module")
def disk_store(runtime_dir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The ``store`` section: 1 MiB of DRAM and a 64 MiB disk tier; stopped at the end."""
    cfg = {"backend": "local", "name": f"sgd{uuid.uuid4().hex[:10]}", "capacity": DRAM,
           "runtime_dir": str(runtime_dir), "verify_checksums": True,
           "hot_timeout_s": TEST_HOT_TIMEOUT_S,
           "disk": {"path": str(tmp_path_factory.mktemp("sglang-ssd")), "capacity": "64mb",
                    "high_watermark": 0.25}}
    yield cfg
    launcher.stop(StoreConfig.from_dict(cfg))


def _tiers(cfg: dict[str, Any]) -> dict[str, int]:
    with open_store(cfg) as store:
        st = store.stats()
    return {k: int(st[k]) for k in TIER_COUNTERS}


@pytest.fixture(scope="module")
def through_disk(harness: Harness, disk_store: dict[str, Any]) -> dict[str, Any]:
    """Write the cases' pages and the filler in the harness process, then read the cases'
    pages in a second, fresh process into pages 6, 0, 9, 3 of zeroed pools; the store's
    tier counters around that read."""
    harness.call("check_disk_settings", store=disk_store)  # starts the store, disk tier on
    cases = {cid: {"mla": mla, "layout": layout, "model": "disk", "pool": GEOMETRY}
             for (mla, layout), cid in zip(CASES, CASE_IDS)}
    wrote = harness.call("write_past_dram", store=disk_store, cases=cases,
                         filler={"pool": GEOMETRY, "batches": FILLER_BATCHES})
    before = _tiers(disk_store)
    reads = {cid: {**case, "keys": wrote["cases"][cid]["keys"], "pages": [6, 0, 9, 3],
                   "exists_each": True} for cid, case in cases.items()}
    proc = subprocess.run([sys.executable, str(WORKER),
                           json.dumps({"store": disk_store, "cases": reads})],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    read = json.loads(proc.stdout.strip().splitlines()[-1])
    want = len(CASES) * PAGES
    # the reader's settle (promotions) travels without a reply: wait until it is applied
    wait_until(lambda: _tiers(disk_store)["promotions"] - before["promotions"] >= want, 10)
    after = _tiers(disk_store)
    return {"wrote": wrote, "read": read, "before": before, "after": after}


def test_sglang_settings_carry_the_disk_tier(through_disk: dict[str, Any],
                                             disk_store: dict[str, Any]) -> None:
    st = through_disk["wrote"]["stats"]  # the coordinator the backend started
    assert st["disk_capacity_bytes"] == parse_size(disk_store["disk"]["capacity"])
    assert st["capacity_bytes"] == parse_size(DRAM)
    dirs = disk_dir(StoreConfig.from_dict(disk_store))
    assert dirs is not None and any(dirs.rglob("*.kvc")), "no file in the disk tier"


def test_pages_left_dram_for_disk(through_disk: dict[str, Any]) -> None:
    wrote = through_disk["wrote"]
    st = wrote["stats"]
    assert wrote["filler_bytes"] >= 4 * parse_size(DRAM)
    assert st["dropped_undemoted"] == 0, st  # every page that left DRAM is on disk
    assert st["demotions"] >= len(CASES) * PAGES and st["dram_evictions"] > 0, st
    assert st["used_bytes"] <= st["capacity_bytes"], st
    assert st["disk_objects"] >= len(CASES) * PAGES, st
    assert st["dram_objects"] < st["keys"], st  # some objects are on disk only


@pytest.mark.parametrize("cid", CASE_IDS)
def test_fresh_process_finds_and_reads_disk_pages(through_disk: dict[str, Any],
                                                  cid: str) -> None:
    wrote, read = through_disk["wrote"]["cases"][cid], through_disk["read"][cid]
    assert wrote["set"] == [True] * PAGES
    assert read["exists_each"] == [True] * PAGES  # SGLang's exists(key), page by page
    assert read["exists"] == PAGES  # batch_exists: the leading run, all on disk
    assert read["loaded"] == [True] * PAGES
    assert read["digests"] == wrote["digests"]  # 1 -> 6, 2 -> 0, 3 -> 9, 4 -> 3, exactly
    assert len(set(wrote["digests"])) == PAGES and read["others_zero"]


def test_reads_came_from_disk_and_were_promoted(through_disk: dict[str, Any]) -> None:
    before, after = through_disk["before"], through_disk["after"]
    delta = {k: after[k] - before[k] for k in TIER_COUNTERS}
    want = len(CASES) * PAGES
    nbytes = sum(PAGES * c["object_bytes"] for c in through_disk["wrote"]["cases"].values())
    # each page was leased once, from its file, never from DRAM
    assert delta["disk_hits"] == want and delta["dram_hits"] == 0, delta
    assert delta["disk_read_bytes"] == nbytes, delta
    assert delta["promotions"] == want, delta  # read whole, verified, kept in DRAM
    assert delta["disk_corrupt"] == 0 and delta["disk_missing"] == 0, delta


def test_this_process_never_imported_sglang() -> None:
    assert "sglang.srt" not in sys.modules  # see sglang_harness: its import changes globals
