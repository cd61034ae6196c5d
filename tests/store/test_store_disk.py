"""The local store's disk tier (docs/store.md §Disk tier): config, contract with a tiny DRAM,
tier moves, multi-process stress, kill -9 during demotion, and real faults."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvcentric.config import StoreConfig
from kvcentric.store import OK, open_store
from kvcentric.store.local import launcher
from kvcentric.store.local.client import LocalStore
from kvcentric.store.local.config import MAX_PUT_WAIT_S, DiskConfig, disk_dir, socket_path
from kvcentric.store.local.disk import DATA_OFFSET
from tests.helpers.payload import payload, size_of
from tests.helpers.waiting import wait_until
from tests.store.store_contract import WORKER, StoreContract, get, put

MB = 1 << 20


def as_dict(cfg: StoreConfig) -> dict[str, Any]:
    assert cfg.local.disk is not None
    return {"name": cfg.name, "capacity_bytes": cfg.local.capacity_bytes,
            "runtime_dir": str(cfg.local.runtime_dir), "verify_checksums": cfg.verify_checksums,
            "disk": {"path": str(cfg.local.disk.path), "capacity": cfg.local.disk.capacity_bytes}}


@pytest.fixture
def disk_cfg(store_cfg: StoreConfig, tmp_path: Path) -> Iterator[StoreConfig]:
    """A store with 16 MiB of DRAM and a 256 MiB disk tier under ``tmp_path``. A writer
    held back for the demoter waits the longest bound (``MAX_PUT_WAIT_S``): these tests put
    faster than a disk writes, and on a box whose disk is busy the default wait lapsed
    before one demotion completed, refusing a put the test did not expect to be refused
    (tests/store/test_store_demotion.py tests the refusal itself)."""
    cfg = store_cfg.with_(capacity_bytes=16 * MB,
                          disk=DiskConfig(tmp_path / "disk", 256 * MB,
                                          put_wait_s=MAX_PUT_WAIT_S))
    yield cfg
    launcher.stop(cfg)


@pytest.fixture
def store(disk_cfg: StoreConfig) -> Iterator[LocalStore]:
    s = open_store(disk_cfg)
    assert isinstance(s, LocalStore)
    yield s
    s.close()


@pytest.fixture
def store_config(disk_cfg: StoreConfig) -> dict[str, Any]:
    return as_dict(disk_cfg)


class TestDiskContract(StoreContract):
    """The whole KVStore contract with the disk tier on and DRAM tiny."""


def _wait(pred: Any, timeout: float = 20.0) -> bool:
    return wait_until(pred, timeout)


def _fill(store: LocalStore, prefix: str, n: int, batch: int = 8,
          paced: bool = False, one_chain: bool = True) -> list[str]:
    """Put ``n`` objects (64-256 KiB each) in batches, chained into one prefix chain (else
    one chain per batch); returns the keys. ``paced`` waits for the demotions after each
    batch (writes no faster than the disk)."""
    keys = [f"{prefix}/{i}" for i in range(n)]
    for i in range(0, n, batch):
        b = keys[i:i + batch]
        first = keys[i - 1] if i and one_chain else None
        assert put(store, b, [first, *b[:-1]]) == [OK] * len(b)
        if paced:
            assert _wait(lambda: store.stats()["demoting"] == 0)
    return keys


def _settled(store: LocalStore) -> bool:
    st = store.stats()
    return st["demoting"] == 0 and st["disk_recovering"] == 0


def _file_of(cfg: StoreConfig, key: str) -> Path:
    assert disk_dir(cfg) is not None
    h = xxhash.xxh3_128_hexdigest(key.encode())
    (path,) = (disk_dir(cfg) / h[:2]).glob(f"{h}-*.kvc")
    return path


# ---- config ----
def test_disk_config_parses_and_checks_the_file_system(tmp_path: Path) -> None:
    cfg = StoreConfig.from_dict({"capacity": "16mb",
                                 "disk": {"path": str(tmp_path / "d"), "capacity": "1mb"}})
    assert cfg.local.disk == DiskConfig(tmp_path / "d", 1 * MB)
    assert disk_dir(cfg) == tmp_path / "d" / "default"
    assert StoreConfig.from_dict({"capacity": "16mb"}).local.disk is None  # today's behaviour
    (tmp_path / "file").write_text("x")
    for bad, why in (({"path": str(tmp_path / "file" / "d"), "capacity": "1mb"}, "directory"),
                     ({"path": str(tmp_path), "capacity": "1000tb"}, "free space"),
                     ({"path": str(tmp_path)}, "path and capacity"),
                     ({"path": str(tmp_path), "capacity": "1mb", "bogus": 1}, "unknown"),
                     ({"path": str(tmp_path), "capacity": 0}, "positive")):
        with pytest.raises(ValueError, match=why):
            StoreConfig.from_dict({"disk": bad})
    # the coordinator gets the disk tier through the launcher's JSON
    again = StoreConfig.from_dict(json.loads(launcher.config_json(cfg)))
    assert again.local.disk == cfg.local.disk


# ---- tiers ----
def test_objects_move_to_disk_stream_back_and_promote(store: LocalStore,
                                                      disk_cfg: StoreConfig) -> None:
    keys = _fill(store, "mv", 256, paced=True)  # ~40 MiB through a 16 MiB DRAM
    assert _wait(lambda: _settled(store))
    st = store.stats()
    assert st["keys"] == 256 and st["dropped_undemoted"] == 0, st
    assert st["demotions"] > 0 and st["disk_objects"] > 0 and st["used_bytes"] <= 16 * MB
    assert store.batch_exists(keys) == 256  # the leading run spans both tiers
    cold = keys[:4]  # long gone from DRAM
    sizes = [size_of(k) for k in cold]
    lease = store.batch_acquire_streamed(cold, sizes)
    try:
        assert lease.keys == cold
        span = 16 << 10
        for off in range(0, max(sizes), span):  # layer-sized ranges, as the connector does
            store.fetch_range(lease, off, span)
        for k, p, s in zip(cold, lease.ptrs, lease.sizes):
            view = np.ctypeslib.as_array((ctypes.c_uint8 * s).from_address(p))
            assert np.array_equal(view, payload(k, s)), k
        assert store.lease_valid(lease)
    finally:
        store.release(lease)
    after = store.stats()
    assert after["disk_hits"] >= 4 and after["promotions"] >= 1
    before_dram = after["dram_hits"]
    assert all(b is not None for b in get(store, cold))
    assert store.stats()["dram_hits"] > before_dram  # promoted copies answer from DRAM


@pytest.mark.serial  # loads both cores: other tests' bounds break beside it
def test_multiprocess_stress_with_disk(disk_cfg: StoreConfig) -> None:
    """4 processes put, get, read in place and remove for 20 s over a working set ~6x DRAM;
    every byte read back is checked while objects move between tiers."""
    cfg = disk_cfg.with_(capacity_bytes=8 * MB)
    monitor = open_store(cfg)
    procs = [subprocess.Popen([sys.executable, str(WORKER), json.dumps(as_dict(cfg)), "stress",
                               "20", str(seed)], stdout=subprocess.PIPE, text=True)
             for seed in range(4)]
    peak = 0
    deadline = time.monotonic() + 600
    while any(p.poll() is None for p in procs):
        assert time.monotonic() < deadline, "the stress workers did not finish"
        st = monitor.stats()
        peak = max(peak, st["used_bytes"])
        assert st["disk_used_bytes"] <= st["disk_capacity_bytes"]
        time.sleep(0.1)
    results = [json.loads(p.communicate()[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert _wait(lambda: _settled(monitor))
    st = monitor.stats()
    monitor.close()
    assert peak <= cfg.local.capacity_bytes
    assert sum(r["bad"] for r in results) == 0
    assert sum(r["gets"] for r in results) > 100
    assert st["demotions"] > 50 and st["disk_hits"] > 50 and st["promotions"] > 0, st
    assert st["leases"] == 0 and st["pending"] == 0


# ---- restart ----
def test_kill9_during_demotion_keeps_what_reached_disk(store: LocalStore,
                                                       disk_cfg: StoreConfig) -> None:
    keys = _fill(store, "k9", 200, paced=True)
    assert _wait(lambda: _settled(store))
    keys += _fill(store, "k9b", 120)  # more demotions, in flight while we kill
    st = store.stats()
    on_disk, pid = st["disk_objects"], st["pid"]
    os.kill(pid, signal.SIGKILL)
    assert _wait(lambda: not launcher.pid_alive(pid))
    # damage two complete files and leave a torn write behind
    torn, rotten = _file_of(disk_cfg, keys[0]), _file_of(disk_cfg, keys[1])
    with open(rotten, "r+b") as f:
        f.seek(DATA_OFFSET + 1000)
        byte = f.read(1)
        f.seek(DATA_OFFSET + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.truncate(torn, torn.stat().st_size - 4096)
    (torn.parent / (torn.name + ".tmp")).write_bytes(b"half")
    assert _wait(lambda: store.health_check())  # reconnects: a fresh coordinator
    assert _wait(lambda: _settled(store))
    st = store.stats()
    assert st["pid"] != pid and st["recovery_dropped"] == 2, st
    assert st["recovered"] >= on_disk - 2
    assert not list(torn.parent.glob("*.tmp"))
    present = [k for k in keys if store.batch_exists([k]) == 1]
    assert keys[0] not in present and keys[1] not in present
    assert len(present) == st["recovered"]
    for k, b in zip(present, get(store, present)):  # every recovered byte is right
        assert b is not None and np.array_equal(b, payload(k, b.nbytes)), k


# ---- faults ----
def test_disk_full_for_real_drops_counted_and_serves(store: LocalStore) -> None:
    """The kernel refuses the coordinator's disk writes (RLIMIT_FSIZE: EFBIG); DRAM
    evictions then drop objects outright, counted, and the store keeps serving."""
    pid = store.stats()["pid"]
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (DATA_OFFSET + 4096, DATA_OFFSET + 4096))
    keys = _fill(store, "full", 200)
    assert _wait(lambda: _settled(store))
    st = store.stats()
    assert st["disk_full"] > 0 and st["demotions"] == 0 and st["disk_objects"] == 0, st
    assert st["dropped_undemoted"] > 0 and st["used_bytes"] <= 16 * MB
    assert st["disk_used_bytes"] == 0
    assert store.batch_exists(keys[-4:]) == 4
    for k, b in zip(keys[-4:], get(store, keys[-4:])):
        assert b is not None and np.array_equal(b, payload(k, b.nbytes))


def test_disk_capacity_bound_evicts_leaves_from_disk(disk_cfg: StoreConfig) -> None:
    # a disk (8 MiB) smaller than DRAM (16 MiB) and late write-back: the disk fills with
    # disk-only objects, whose leaves are what the bound evicts
    assert disk_cfg.local.disk is not None
    cfg = disk_cfg.with_(disk=dataclasses.replace(disk_cfg.local.disk, capacity_bytes=8 * MB,
                                                  high_watermark=0.8))
    with open_store(cfg) as s:
        assert isinstance(s, LocalStore)
        # one chain per batch: a disk-only chain leaf is what leaves the disk (leaf-first)
        keys = _fill(s, "cap", 300, paced=True, one_chain=False)
        assert _wait(lambda: _settled(s))
        st = s.stats()
        assert st["disk_used_bytes"] <= 8 * MB and st["disk_evictions"] > 0, st
        assert s.batch_exists(keys[-4:]) == 4
        root = disk_dir(cfg)
        assert root is not None  # evicted files are unlinked by the I/O thread, soon after
        assert _wait(lambda: sum(f.stat().st_size for f in root.rglob("*.kvc")) <= 8 * MB)


def test_unwritable_disk_dir_is_counted_and_served_around(store: LocalStore,
                                                          disk_cfg: StoreConfig) -> None:
    keys = _fill(store, "uw", 150, paced=True)
    assert _wait(lambda: _settled(store))
    root = disk_dir(disk_cfg)
    assert root is not None
    root.rename(root.with_name("moved"))
    root.write_text("not a directory")  # every later write fails, even for root
    more = _fill(store, "uw2", 150)
    assert _wait(lambda: _settled(store))
    st = store.stats()
    assert st["disk_errors"] > 0 and st["dropped_undemoted"] > 0, st
    # objects whose files vanished read as missing: the run ends, nothing wrong is served
    got = get(store, keys[:3])
    assert got[0] is None and store.stats()["disk_missing"] >= 1
    assert store.batch_exists(keys[:1]) == 0
    for k, b in zip(more[-4:], get(store, more[-4:])):
        assert b is not None and np.array_equal(b, payload(k, b.nbytes))


def test_file_deleted_or_corrupted_under_us(store: LocalStore, disk_cfg: StoreConfig) -> None:
    keys = _fill(store, "dc", 256, paced=True)
    assert _wait(lambda: _settled(store))
    gone, rotten = keys[0], keys[1]
    _file_of(disk_cfg, gone).unlink()
    path = _file_of(disk_cfg, rotten)
    with open(path, "r+b") as f:
        f.seek(DATA_OFFSET + 7)
        f.write(b"\x00\x01\x02\x03")
    assert get(store, [gone]) == [None]
    assert store.stats()["disk_missing"] == 1 and store.batch_exists([gone]) == 0
    # a streamed read of the corrupt object: every range arrives, the checksum refuses it
    size = size_of(rotten)
    lease = store.batch_acquire_streamed([rotten], [size])
    assert lease.keys == [rotten]
    store.fetch_range(lease, 0, size)
    assert not store.lease_valid(lease)
    store.release(lease)
    assert _wait(lambda: store.stats()["disk_corrupt"] == 1)
    assert store.batch_exists([rotten]) == 0 and get(store, [rotten]) == [None]
    assert not path.exists() or _wait(lambda: not path.exists())
    ok = keys[2:6]
    for k, b in zip(ok, get(store, ok)):
        assert b is not None and np.array_equal(b, payload(k, b.nbytes))


def test_tier_metrics_in_stats_log_and_prometheus(store: LocalStore) -> None:
    from kvcentric.store.metrics import log_line, prometheus_text

    keys = _fill(store, "m", 160, paced=True)
    assert all(b is not None for b in get(store, keys[:2]))  # disk hits
    st = store.stats()
    assert st["disk_hits"] >= 2 and st["demotions"] > 0 and st["disk_write_bytes"] > 0
    assert st["dram_objects"] + st["disk_objects"] >= st["keys"]
    assert " | Disk: " in log_line(st) and f"Demoted: {st['demotions']}" in log_line(st)
    text = prometheus_text(st, "s").decode()
    for name in ("disk_hits_total", "dram_hits_total", "demotions_total", "promotions_total",
                 "disk_used_bytes", "disk_write_bytes_total", "disk_read_bytes_total",
                 "dram_evictions_total", "disk_evictions_total", "dropped_undemoted_total"):
        assert f'kvcentric_store_{name}{{store="s"}}' in text, name
    assert f'kvcentric_store_demotions_total{{store="s"}} {float(st["demotions"])}' in text


def test_store_serve_command_runs_the_disk_tier(store_cfg: StoreConfig, tmp_path: Path) -> None:
    """``kvcentric store serve --disk-path --disk-capacity`` as an operator runs it: the
    foreground coordinator demotes what its DRAM cannot hold; a half-given tier is refused
    with a message."""
    base = [sys.executable, "-m", "kvcentric.cli", "store", "serve", "--name", store_cfg.name,
            "--runtime-dir", str(store_cfg.local.runtime_dir), "--capacity", "16mb"]
    bad = subprocess.run(base + ["--disk-capacity", "1gb"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--disk-capacity needs --disk-path" in bad.stderr
    assert "Traceback" not in bad.stderr
    proc = subprocess.Popen(base + ["--disk-path", str(tmp_path / "d"), "--disk-capacity",
                                    "256mb"], stderr=subprocess.DEVNULL, start_new_session=True)
    cfg = store_cfg.with_(capacity_bytes=16 * MB, autostart=False)
    try:
        assert _wait(lambda: socket_path(cfg).exists() or proc.poll() is not None)
        with open_store(cfg) as s:
            assert isinstance(s, LocalStore)
            keys = _fill(s, "serve", 256, paced=True)  # ~40 MiB through 16 MiB of DRAM
            st = s.stats()
            assert st["disk_capacity_bytes"] == 256 * MB and st["demotions"] > 0
            assert all(b is not None for b in get(s, keys[:8]))  # from disk
            assert s.stats()["disk_hits"] >= 8
    finally:
        proc.terminate()
        proc.wait(timeout=30)
