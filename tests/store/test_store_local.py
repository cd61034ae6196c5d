"""The local shared-memory store: contract, processes, crashes, stress."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import ERR_CORRUPT, ERR_UNAVAILABLE, OK, open_store
from kvcentric.store.local import launcher
from kvcentric.store.local.client import LocalStore
from kvcentric.store.local.ownership import generation_files
from tests.helpers.payload import payload, size_of
from tests.helpers.waiting import wait_until
from tests.store.store_contract import WORKER, StoreContract, get, put, run_worker


def as_dict(cfg: StoreConfig) -> dict[str, Any]:
    return {"name": cfg.name, "capacity_bytes": cfg.local.capacity_bytes,
            "runtime_dir": str(cfg.local.runtime_dir), "verify_checksums": cfg.verify_checksums,
            "hot_timeout_s": cfg.hot_timeout_s}


@pytest.fixture
def store(store_cfg: StoreConfig) -> Iterator[LocalStore]:
    s = open_store(store_cfg)
    assert isinstance(s, LocalStore)
    yield s
    s.close()


@pytest.fixture
def store_config(store_cfg: StoreConfig) -> dict[str, Any]:
    return as_dict(store_cfg)


class TestLocalContract(StoreContract):
    pass


def test_store_outlives_its_starter_and_idle_timeout(store_cfg: StoreConfig) -> None:
    cfg = store_cfg.with_(idle_timeout_s=1.5)
    assert run_worker(as_dict(cfg) | {"idle_timeout_s": 1.5}, "put", "k") == [OK]
    assert launcher.is_running(cfg)  # the worker exited, its coordinator did not
    with open_store(cfg) as s:
        assert s.batch_exists(["k"]) == 1
        pid = s.stats()["pid"]
    # watch the pid, not the socket: a probe connection counts as a client
    assert _wait(lambda: not launcher.pid_alive(pid), timeout=10)
    assert not launcher.is_running(cfg) and not generation_files(cfg, "arena")


def test_concurrent_first_clients_start_one_coordinator(store_cfg: StoreConfig) -> None:
    procs = [subprocess.Popen([sys.executable, str(WORKER), json.dumps(as_dict(store_cfg)),
                               "put", f"c{i}"], stdout=subprocess.PIPE, text=True)
             for i in range(4)]
    assert all(json.loads(p.communicate(timeout=60)[0]) == [OK] for p in procs)
    with open_store(store_cfg) as s:
        assert s.stats()["keys"] == 4


def _spawn_holder(cfg: StoreConfig, mode: str, key: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, str(WORKER), json.dumps(as_dict(cfg)), mode, key],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _wait(pred: Any, timeout: float = 10.0) -> bool:
    return wait_until(pred, timeout)


def test_sigkill_mid_write_and_mid_read_leaks_nothing(store: LocalStore,
                                                      store_cfg: StoreConfig) -> None:
    put(store, ["held"])
    used = store.stats()["used_bytes"]
    writer = _spawn_holder(store_cfg, "hold-write", "half")
    reader = _spawn_holder(store_cfg, "hold-read", "held")
    st = store.stats()
    assert st["pending"] == 1 and st["leases"] == 1 and store.batch_exists(["half"]) == 0
    assert store.remove("held") < 0  # leased
    for p in (writer, reader):
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert _wait(lambda: store.stats()["leases"] == 0 and store.stats()["pending"] == 0)
    st = store.stats()
    assert st["used_bytes"] == used and store.batch_exists(["half"]) == 0
    assert store.remove("held") == OK and store.stats()["used_bytes"] == 0
    assert put(store, ["after"]) == [OK]  # still serving


def test_sigkill_in_a_put_loop_keeps_store_consistent(store: LocalStore,
                                                      store_cfg: StoreConfig) -> None:
    for seed, puts in ((3, 1), (7, 16), (11, 64)):  # killed ever further into its loop
        before = store.stats()["puts"]
        p = subprocess.Popen([sys.executable, str(WORKER), json.dumps(as_dict(store_cfg)),
                              "stress", "30", str(seed)], stdout=subprocess.DEVNULL)
        # mid-flight: its start-up is over and it has stored ``puts`` objects (its loop
        # runs for 30 s, so it is still putting when killed)
        assert wait_until(lambda b=before, n=puts: store.stats()["puts"] >= b + n, 60)
        assert p.poll() is None
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert _wait(lambda: store.stats()["leases"] == 0 and store.stats()["pending"] == 0)
    keys = [f"s/{c}/{j}" for c in range(48) for j in range(6)]
    present = [k for k, b in zip(keys, get(store, keys)) if b is not None]
    assert present, "the killed writers stored nothing"
    for k, b in zip(present, get(store, present)):
        assert b is not None and np.array_equal(b, payload(k, b.nbytes)), k


@pytest.mark.serial  # loads both cores: other tests' bounds break beside it
def test_multiprocess_stress(store_cfg: StoreConfig) -> None:
    """4 processes put, get, read in place and evict for 20 s; every byte is checked."""
    cfg = store_cfg.with_(capacity_bytes=8 << 20)
    monitor = open_store(cfg)
    procs = [subprocess.Popen([sys.executable, str(WORKER), json.dumps(as_dict(cfg)), "stress",
                               "20", str(seed)], stdout=subprocess.PIPE, text=True)
             for seed in range(4)]
    peak = 0
    deadline = time.monotonic() + 600
    while any(p.poll() is None for p in procs):
        assert time.monotonic() < deadline, "the stress workers did not finish"
        peak = max(peak, monitor.stats()["used_bytes"])
        time.sleep(0.1)
    results = [json.loads(p.communicate()[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    st = monitor.stats()
    monitor.close()
    assert peak <= cfg.local.capacity_bytes and st["used_bytes"] <= cfg.local.capacity_bytes
    assert sum(r["bad"] for r in results) == 0
    assert sum(r["gets"] for r in results) > 100 and st["evictions"] > 100
    assert st["leases"] == 0 and st["pending"] == 0


def test_checksums_detect_corruption(store_cfg: StoreConfig) -> None:
    with open_store(store_cfg.with_(verify_checksums=True)) as s:
        assert isinstance(s, LocalStore)
        put(s, ["c/0", "c/1"])
        lease = s.batch_acquire(["c/1"])
        s.arena_view(lease.ptrs[0] + 100, 1)[0] ^= 0xFF  # flip bits of a committed object
        s.release(lease)
        buf = [np.zeros(size_of(k), np.uint8) for k in ("c/0", "c/1")]
        got = s.batch_get_into(["c/0", "c/1"], [b.ctypes.data for b in buf],
                               [b.nbytes for b in buf])
        assert got[0] == buf[0].nbytes and got[1] == ERR_CORRUPT


def test_large_objects_are_checked_to_their_last_byte(store_cfg: StoreConfig) -> None:
    """A put records the stored bytes' checksum, and a bit flipped near the end of a
    large object is caught on get while the other object is served."""
    n = (3 << 20) + 7
    data = [np.random.default_rng(i).integers(0, 255, n, dtype=np.uint8) for i in range(2)]
    with open_store(store_cfg.with_(verify_checksums=True)) as s:
        assert isinstance(s, LocalStore)
        keys = ["big/0", "big/1"]
        assert s.batch_put_from(keys, [d.ctypes.data for d in data], [n, n]) == [OK, OK]
        lease = s.batch_acquire(keys)
        assert all(lease.verified(i) for i in range(2))  # the checksums the put recorded
        s.arena_view(lease.ptrs[1] + n - 3, 1)[0] ^= 0x01
        s.release(lease)
        out = [np.zeros(n, np.uint8) for _ in range(2)]
        got = s.batch_get_into(keys, [o.ctypes.data for o in out], [n, n])
        assert got == [n, ERR_CORRUPT] and np.array_equal(out[0], data[0])


def test_coordinator_death_fails_fast_then_recovers(store: LocalStore,
                                                    store_cfg: StoreConfig) -> None:
    put(store, ["a"])
    pid = store.stats()["pid"]
    os.kill(pid, signal.SIGKILL)
    assert _wait(lambda: not launcher.pid_alive(pid))
    t0 = time.monotonic()
    buf = np.zeros(size_of("a"), np.uint8)
    assert store.batch_get_into(["a"], [buf.ctypes.data], [buf.nbytes]) == [ERR_UNAVAILABLE]
    assert time.monotonic() - t0 < 5
    # the next call reconnects and autostarts a fresh, empty coordinator
    assert _wait(lambda: store.batch_exists(["a"]) == 0 and store.health_check())
    assert put(store, ["b"]) == [OK] and store.stats()["pid"] != pid


def test_cli_serve_stats_stop(store_cfg: StoreConfig) -> None:
    base = [sys.executable, "-m", "kvcentric.cli", "store"]
    common = ["--name", store_cfg.name, "--runtime-dir", str(store_cfg.local.runtime_dir)]
    srv = subprocess.Popen(base + ["serve", *common, "--capacity", "16mb"],
                           stderr=subprocess.PIPE, text=True)
    try:
        assert _wait(lambda: launcher.is_running(store_cfg))
        again = subprocess.run(base + ["serve", *common], capture_output=True, text=True)
        assert again.returncode == 1 and "already running" in again.stderr
        with open_store(store_cfg.with_(autostart=False)) as s:
            put(s, ["k"])
        out = subprocess.run(base + ["stats", *common, "--prometheus"], capture_output=True,
                             text=True, check=True).stdout
        assert f'kvcentric_store_keys{{store="{store_cfg.name}"}} 1.0' in out
        assert 'kvcentric_store_capacity_bytes' in out
        out = subprocess.run(base + ["stats", *common], capture_output=True, text=True,
                             check=True).stdout
        assert out.startswith("Storage: 0.00 / 0.02 GB | Keys: 1")
        subprocess.run(base + ["stop", *common], check=True, capture_output=True)
        assert srv.wait(timeout=10) == 0
    finally:
        if srv.poll() is None:
            srv.kill()


def test_no_autostart_reports_unavailable(store_cfg: StoreConfig) -> None:
    from kvcentric.store import StoreUnavailable
    with pytest.raises(StoreUnavailable):
        open_store(store_cfg.with_(autostart=False))


def test_unstartable_coordinator_is_store_unavailable(tmp_path: Path) -> None:
    """The error contract: a coordinator that dies and cannot be restarted (its runtime dir
    replaced by a file) surfaces as ``StoreUnavailable`` or a negative code from every
    call, fast, never as RuntimeError/TimeoutError/OSError; it recovers once it can start."""
    from kvcentric.store import StoreUnavailable

    rt = tmp_path / "rt"
    cfg = StoreConfig.from_dict({"name": "gone", "capacity_bytes": 16 << 20, "runtime_dir": rt,
                                 "reconnect_interval_s": 0.5})
    store = open_store(cfg)
    try:
        assert put(store, ["a"]) == [OK]
        pid = store.stats()["pid"]
        os.kill(pid, signal.SIGKILL)
        assert _wait(lambda: not launcher.pid_alive(pid))
        rt.rename(tmp_path / "rt.moved")
        rt.write_text("not a directory")  # mkdir/lock/socket all fail, even for root
        buf = np.zeros(size_of("a"), np.uint8)
        t0 = time.monotonic()
        for _ in range(3):  # the first call tries a restart; later ones fail fast
            assert store.batch_exists(["a"]) == 0
            assert put(store, ["b"]) == [ERR_UNAVAILABLE]
            assert store.batch_get_into(["a"], [buf.ctypes.data], [buf.nbytes]) == \
                [ERR_UNAVAILABLE]
            for call in (lambda: store.batch_acquire(["a"]), store.stats,
                         lambda: store.batch_alloc(["c"], [8]),
                         lambda: store.list_keys("")):
                with pytest.raises(StoreUnavailable):
                    call()
            assert not store.health_check()
        assert time.monotonic() - t0 < 5
        with pytest.raises(StoreUnavailable):
            open_store(cfg)  # a tool that needs the store says so
        late = open_store(cfg, required=False)  # an engine starts without it
        assert late.batch_exists(["a"]) == 0 and put(late, ["c"]) == [ERR_UNAVAILABLE]
        late.close()
        rt.unlink()
        # the first call past reconnect_interval_s restarts the coordinator: poll until one has
        assert _wait(lambda: store.health_check())
        assert put(store, ["b"]) == [OK] and store.stats()["pid"] != pid
    finally:
        store.close()
        if rt.is_dir():
            launcher.stop(cfg)
