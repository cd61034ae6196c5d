"""The SGLang HiCache backend (``kvcentric.connector.sglang``), created by SGLang's own
``StorageBackendFactory`` with SGLang's own config classes, on CPU.

- SGLang runs in subprocesses only (``tests/helpers/sglang_harness.py`` explains why):
  the checks themselves are in ``tests/helpers/sglang_checks.py``.
- Host pools: ``tests/helpers/sglang_pool.py`` (SGLang's own layout code, compiled from
  its sources; the pool classes cannot be imported without torchvision).
- Stores: every test but the local-store-failure ones runs once per entry of
  ``STORE_KINDS``: the embedded local store, and a real Mooncake cluster (``mooncake_master``
  and a storage node in the session's network namespace; the SGLang processes run there
  as pure Mooncake clients).
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

from kvcentric.config import StoreConfig
from kvcentric.store.local import launcher
from tests.helpers.e2e_store import TEST_HOT_TIMEOUT_S
from tests.helpers.mooncake_cluster import MooncakeCluster, cluster
from tests.helpers.sglang_harness import Harness

WORKER = Path(__file__).parents[1] / "helpers" / "sglang_worker.py"
CASES = [(False, "page_first"), (False, "layer_first"), (True, "page_first"),
         (True, "layer_first")]
CASE_IDS = [f"{'mla' if m else 'mha'}-{lay}" for m, lay in CASES]
STORE_KINDS = [pytest.param("local", id="local"),
               pytest.param("mooncake", id="mooncake",
                            marks=[pytest.mark.mooncake, pytest.mark.serial])]


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    """One subprocess with SGLang imported, shared by the module's tests."""
    harness = Harness(tmp_path_factory.mktemp("sglang") / "harness.log")
    yield harness
    harness.close()


@pytest.fixture(scope="module", params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def mooncake(store_kind: str, request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster | None]:
    """A Mooncake master and one 64 MiB storage node, for the ``mooncake`` kind."""
    if store_kind != "mooncake":
        yield None
        return
    pytest.importorskip("mooncake.store", reason="the Mooncake wheel is not installed")
    ns = request.getfixturevalue("mooncake_ns")
    with cluster(tmp_path_factory.mktemp("sglang-mooncake"), ns=ns) as c:
        c.start_node("pool", "64mb")
        yield c


@pytest.fixture(scope="module")
def store_config(store_kind: str, mooncake: MooncakeCluster | None,
                 runtime_dir: Path) -> Iterator[dict[str, Any]]:
    """The ``store`` section of the extra config: one store for the module."""
    if mooncake is not None:
        yield mooncake.store_config()  # checksums are the local store's (rejected here)
        return
    cfg = StoreConfig.from_dict({"name": f"sg{uuid.uuid4().hex[:10]}", "capacity_bytes": 64 << 20,
                                 "runtime_dir": runtime_dir, "verify_checksums": True})
    yield {"backend": "local", "name": cfg.name, "capacity": cfg.local.capacity_bytes,
           "runtime_dir": str(runtime_dir), "verify_checksums": True,
           "hot_timeout_s": TEST_HOT_TIMEOUT_S}
    launcher.stop(cfg)


Reader = tuple[subprocess.Popen[str], Path]  # the reading process, the log of its stderr


@pytest.fixture(scope="module")
def reader(mooncake: MooncakeCluster | None, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Reader]:
    """A fresh process (tests/helpers/sglang_worker.py) that reads what the harness stored,
    started before the harness so that their SGLang imports overlap; it waits for its
    spec on stdin (:func:`cross_process`). Yields it and the log of its stderr."""
    cmd = [sys.executable, str(WORKER), "-"]
    log = tmp_path_factory.mktemp("sglang-reader") / "reader.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(mooncake.ns.wrap(cmd) if mooncake else cmd, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                start_new_session=True)
    yield proc, log
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


@pytest.fixture(scope="module")
def harness(reader: Reader, sglang: Harness, mooncake: MooncakeCluster | None,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    """The SGLang subprocess for this store kind: for Mooncake one started inside the
    cluster's namespace (a process keeps the namespace it was started in). ``reader``
    comes first: it starts before the harness's blocking import, and imports beside it."""
    if mooncake is None:
        yield sglang
        return
    with mooncake.entered():
        h = Harness(tmp_path_factory.mktemp("sglang-mc") / "harness.log")
    yield h
    h.close()


def test_factory_builds_backend_and_waits_for_pool(harness: Harness,
                                                  store_config: dict[str, Any]) -> None:
    harness.call("check_factory", store=store_config)


def test_shipped_config_builds_a_v1_backend(harness: Harness,
                                            store_config: dict[str, Any]) -> None:
    path = Path(__file__).parents[2] / "configs" / "sglang-hicache-kvcentric.json"
    harness.call("check_shipped_config", store=store_config, path=str(path))


def test_bad_config_is_a_clear_error(harness: Harness, store_config: dict[str, Any]) -> None:
    harness.call("check_bad_config", store=store_config)


@pytest.fixture(scope="module")
def cross_process(harness: Harness, store_config: dict[str, Any],
                  reader: Reader) -> dict[str, Any]:
    """Store pages 1-4 per case in the harness process, then load them in a second,
    fresh process (one for all cases) into pages 6, 0, 9, 3 of a zeroed pool."""
    cases = {cid: {"mla": mla, "layout": layout, "model": "xp"}
             for (mla, layout), cid in zip(CASES, CASE_IDS)}
    wrote = harness.call("write_cases", store=store_config, cases=cases)
    reads = {cid: {**case, "keys": wrote[cid]["keys"], "pages": [6, 0, 9, 3]}
             for cid, case in cases.items()}
    proc, log = reader
    out, _ = proc.communicate(json.dumps({"store": store_config, "cases": reads}) + "\n",
                              timeout=180)
    assert proc.returncode == 0, log.read_text()[-3000:]
    read = json.loads(out.strip().splitlines()[-1])
    return {cid: (wrote[cid], read[cid]) for cid in CASE_IDS}


@pytest.mark.parametrize("cid", CASE_IDS)
def test_another_process_reads_identical_bytes(cross_process: dict[str, Any], cid: str) -> None:
    wrote, read = cross_process[cid]
    assert wrote["set"] == [True] * 4
    assert read["exists"] == 4
    assert read["loaded"] == [True] * 4
    assert read["digests"] == wrote["digests"]  # 1 -> 6, 2 -> 0, 3 -> 9, 4 -> 3, exactly
    assert len(set(wrote["digests"])) == 4 and read["others_zero"]


@pytest.mark.parametrize(("mla", "layout"), CASES, ids=CASE_IDS)
def test_missing_keys_read_as_false(harness: Harness, store_config: dict[str, Any], mla: bool,
                                    layout: str) -> None:
    harness.call("check_missing", store=store_config, mla=mla, layout=layout)


@pytest.mark.parametrize(("mla", "layout"), CASES, ids=CASE_IDS)
def test_legacy_and_v1_interfaces_share_objects(harness: Harness, store_config: dict[str, Any],
                                                mla: bool, layout: str) -> None:
    harness.call("check_legacy_shares_objects", store=store_config, mla=mla, layout=layout)


@pytest.mark.parametrize(("mla", "layout"), CASES, ids=CASE_IDS)
def test_objects_written_for_another_page_rank_or_layout_read_as_misses(
        harness: Harness, store_config: dict[str, Any], mla: bool, layout: str) -> None:
    harness.call("check_integrity", store=store_config, mla=mla, layout=layout)


@pytest.mark.parametrize(("mla", "layout"), CASES, ids=CASE_IDS)
def test_legacy_interface_by_pointer_round_trips(harness: Harness,
                                                 store_config: dict[str, Any], mla: bool,
                                                 layout: str) -> None:
    harness.call("check_legacy_pointer_round_trip", store=store_config, mla=mla, layout=layout)


def test_mla_only_rank0_writes_every_rank_reads(harness: Harness,
                                                store_config: dict[str, Any]) -> None:
    harness.call("check_mla_writer", store=store_config)


def test_keys_separate_ranks_layouts_and_models(harness: Harness,
                                                store_config: dict[str, Any]) -> None:
    harness.call("check_key_separation", store=store_config)


def test_stats_per_call_and_cumulative(harness: Harness, store_config: dict[str, Any]) -> None:
    harness.call("check_stats", store=store_config)


def test_clear_removes_only_this_key_space(harness: Harness,
                                           store_config: dict[str, Any]) -> None:
    harness.call("check_clear", store=store_config)


def _local(cfg: StoreConfig) -> dict[str, Any]:
    return {"name": cfg.name, "capacity": cfg.local.capacity_bytes,
            "runtime_dir": str(cfg.local.runtime_dir), "op_timeout_s": 2.0,
            "hot_timeout_s": cfg.hot_timeout_s}


def test_store_never_started_reads_as_misses(sglang: Harness, store_cfg: StoreConfig) -> None:
    sglang.call("check_store_never_started", store=_local(store_cfg))
    assert not launcher.is_running(store_cfg)


def test_store_stopping_midway_reads_as_misses(sglang: Harness,
                                               store_cfg: StoreConfig) -> None:
    sglang.call("check_store_stops_midway", store=_local(store_cfg))


def test_this_process_never_imported_sglang() -> None:
    assert "sglang.srt" not in sys.modules  # see sglang_harness: its import changes globals
