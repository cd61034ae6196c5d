"""Nothing committed is lost while the disk has room (issue 31 item 2; docs/store.md
§Disk tier): writers wait for the demoter, bounded, or are refused (counted, never visible), and
only a disk with no room makes the tier drop what it could not write. Units of the index and
the holdback first; then real processes flooding a real coordinator, and a coordinator whose
disk writes wait for a file (the disk being behind, on cue)."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import ERR_NO_SPACE, ERR_NOT_FOUND, OK, open_store
from kvcentric.store.local import launcher, tiered
from kvcentric.store.local.config import DiskConfig
from kvcentric.store.local.demoter import WriteDone, WriteJob
from kvcentric.store.local.disk import DATA_OFFSET
from kvcentric.store.local.holdback import POLL_S, Holdback
from kvcentric.store.local.tiered import HOLD, TieredIndex
from tests.helpers.payload import payload
from tests.helpers.waiting import wait_until

MB = 1 << 20
HELPER = Path(__file__).parents[1] / "helpers" / "flood_worker.py"


# ---- units: the index and the holdback, no I/O ----
@dataclass
class _Io:
    """The I/O threads of a TieredIndex, finished by hand."""

    jobs: list[WriteJob] = field(default_factory=list)

    def submit(self, job: Any) -> None:
        if isinstance(job, WriteJob):
            self.jobs.append(job)

    def finish(self, idx: TieredIndex, ok: bool = True) -> None:
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            idx.demoted(WriteDone(job.token, ok, 0, full=not ok, path=job.path),
                        time.monotonic())


def _index(io: _Io, dram_mb: int = 8, **kw: Any) -> TieredIndex:
    return TieredIndex(dram_mb * MB, 64 * MB, Path("/sim"), kw.pop("high_watermark", 0.0),
                       io.submit, **kw)


def _commit(idx: TieredIndex, key: str, hold: bool = False) -> int:
    off = idx.reserve(key, MB, None, 1, hold=hold)
    if off >= 0:
        assert idx.commit(key, 1, None) == OK
    idx.pump(time.monotonic())
    return off


def test_reserve_holds_at_the_dirty_limit_and_never_drops_undemoted() -> None:
    io = _Io()
    idx = _index(io, dirty_limit=0.5)
    assert all(_commit(idx, f"a{i}", hold=True) >= 0 for i in range(4))
    assert idx.undemoted_bytes() == 4 * MB and len(io.jobs) == 4  # written back at once
    assert idx.reserve("b0", MB, None, 1, hold=True) == HOLD  # at the bound: wait
    assert all(_commit(idx, f"b{i}") >= 0 for i in range(4))  # bound waived: free room only
    # DRAM full of objects with no disk copy: wait, or be refused; never drop one
    assert idx.reserve("c", MB, None, 1, hold=True) == HOLD
    assert idx.reserve("c", MB, None, 1) == ERR_NO_SPACE and "c" not in idx.entries
    st = idx.stats()
    assert st["refused_undemoted"] == st["rejected_puts"] == 1
    assert st["dropped_undemoted"] == 0 and st["keys"] == 8
    io.finish(idx)  # the disk caught up: clean copies are dropped for room instead
    assert idx.undemoted_bytes() == 0
    assert _commit(idx, "c", hold=True) >= 0
    st = idx.stats()
    assert st["dram_evictions"] == 1 and st["dropped_undemoted"] == 0 and st["keys"] == 9
    assert idx.leading_run([f"a{i}" for i in range(4)]) == 4  # the evicted one is on disk


def test_a_waiting_writer_demotes_below_the_watermark() -> None:
    io = _Io()
    idx = _index(io, high_watermark=0.9)
    _commit(idx, "dirty0")
    _commit(idx, "dirty1")
    assert not io.jobs  # 2 MiB dirty: under the watermark, nothing to write yet
    for i in range(6):  # pending writes fill the rest of DRAM
        assert idx.reserve(f"p{i}", MB, None, 2) >= 0
    assert idx.reserve("x", MB, None, 1, hold=True) == HOLD
    idx.pump(time.monotonic())
    assert len(io.jobs) == 2  # the writer waits: every dirty object goes to disk now


def test_a_disk_with_no_room_makes_the_tier_a_dram_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiered, "BACKOFF_S", 0.2)
    io = _Io()
    idx = _index(io, dirty_limit=0.5)
    for i in range(8):
        _commit(idx, f"k{i}")
    io.finish(idx, ok=False)  # ENOSPC: the disk has no room, demotion backs off
    assert idx.disk_stalled(time.monotonic()) and idx.stats()["disk_full"] > 0
    # nobody waits; the coldest dirty leaf is dropped for the new object, counted
    assert idx.reserve("new", MB, None, 1, hold=True) >= 0
    st = idx.stats()
    assert st["dropped_undemoted"] == 1 and "k0" not in idx.entries and st["put_waits"] == 0
    assert wait_until(lambda: not idx.disk_stalled(time.monotonic()), 5)
    # the backoff is over: the disk may have room again, so writers wait once more
    assert idx.reserve("newer", MB, None, 1, hold=True) == HOLD
    assert idx.stats()["dropped_undemoted"] == 1


def test_holdback_is_fifo_bounded_and_forgets_gone_clients() -> None:
    io = _Io()
    idx = _index(io, dram_mb=4, dirty_limit=1.0)
    hb = Holdback(idx, wait_s=0.05)
    now = time.monotonic()
    assert hb.timeout(now) is None
    assert hb.reserve(1, ["f0", "f1"], [MB, MB], [None, "f0"], now) is not None  # room
    for i in range(2):
        _commit(idx, f"g{i}")
    assert hb.reserve(1, ["a0", "a1"], [MB, MB], [None, "a0"], now) is None  # no room: parked
    assert hb.reserve(2, ["b"], [MB], [None], now) is None  # behind it, even if it fit
    assert hb.holds(1) and hb.holds(2) and 0 < hb.timeout(now) <= POLL_S  # type: ignore[operator]
    assert hb.due(now) == [] and idx.stats()["put_waits"] == 2
    for k in ("f0", "f1"):  # the writer of f* gives up: only g* hold DRAM
        idx.abort(k, 1)
    io.finish(idx)
    done = hb.due(time.monotonic())
    assert [owner for owner, _ in done] == [1, 2]  # first come, first served
    assert all(code >= 0 for _, codes in done for code in codes)
    assert [len(codes) for _, codes in done] == [2, 1]
    # nothing frees room in time: refused at the deadline, and never visible
    for k in ("a0", "a1", "b"):
        assert idx.commit(k, 1 if k != "b" else 2, None) == OK
    assert _commit(idx, "h") >= 0  # takes the last clean copy's place: DRAM is all dirty
    assert hb.reserve(3, ["late"], [MB], [None], now) is None
    assert hb.due(now + 0.06) == [(3, [ERR_NO_SPACE])] and "late" not in idx.entries
    assert idx.stats()["refused_undemoted"] == 1
    assert hb.reserve(4, ["gone"], [MB], [None], now) is None
    hb.forget(4)  # its connection closed: it is not retried for a stranger
    assert not hb.holds(4) and hb.due(now + 1) == [] and "gone" not in idx.entries


def test_disk_config_validates_the_holdback_knobs(tmp_path: Path) -> None:
    d = DiskConfig(tmp_path, MB)
    assert (d.writers, d.high_watermark, d.dirty_fraction, d.put_wait_s) == (4, 0.0, 0.5, 0.025)
    assert DiskConfig(tmp_path, MB, high_watermark=0.8).dirty_fraction == 0.8
    parsed = StoreConfig.from_dict({"disk": {"path": str(tmp_path), "capacity": "1mb",
                                             "dirty_limit": 0.7, "put_wait_s": "0.01"}})
    assert parsed.local.disk is not None and parsed.local.disk.dirty_fraction == 0.7
    assert parsed.local.disk.put_wait_s == 0.01
    again = StoreConfig.from_dict(json.loads(launcher.config_json(parsed)))
    assert again.local.disk == parsed.local.disk  # the coordinator gets them
    for bad, why in (({"dirty_limit": 0.1, "high_watermark": 0.2}, "dirty_limit"),
                     ({"dirty_limit": 1.5}, "dirty_limit"), ({"put_wait_s": -1}, "put_wait_s"),
                     ({"put_wait_s": 5}, "put_wait_s"), ({"put_wait_s": "nan"}, "put_wait_s"),
                     ({"writers": 0}, "writers"), ({"writers": 1000}, "writers"),
                     ({"high_watermark": -0.1}, "high_watermark"),
                     ({"dirty_limit": "lots"}, "dirty_limit")):
        with pytest.raises(ValueError, match=why):
            StoreConfig.from_dict({"disk": {"path": str(tmp_path), "capacity": "1mb", **bad}})


# ---- real processes ----
def _flood(cfg: StoreConfig, writers: int, n: int, size: int,
           batch: int) -> list[dict[str, Any]]:
    """``writers`` processes put ``n`` objects each, starting together; their results with
    their keys."""
    procs = [subprocess.Popen([sys.executable, str(HELPER), "flood", launcher.config_json(cfg),
                               f"w{w}", str(n), str(size), str(batch)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for w in range(writers)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs)
    results = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    for w, r in enumerate(results):
        r["keys"] = [f"w{w}/{i}" for i in range(n)]
    return results


def _read_back(store: Any, keys: list[str], size: int) -> tuple[list[str], list[str]]:
    """(keys read back bit-exact, keys not found); any other outcome fails the test."""
    exact, missing = [], []
    for k in keys:
        buf = np.zeros(size, np.uint8)
        (got,) = store.batch_get_into([k], [buf.ctypes.data], [size])
        if got == ERR_NOT_FOUND:
            missing.append(k)
            continue
        assert got == size and np.array_equal(buf, payload(k, size)), (k, got)
        exact.append(k)
    return exact, missing


def _settled(store: Any) -> bool:
    st = store.stats()
    return st["demoting"] == 0 and st["disk_recovering"] == 0


def test_writer_flood_loses_nothing_while_the_disk_has_room(store_cfg: StoreConfig,
                                                            tmp_path: Path) -> None:
    """Issue 31's reproduction: two processes put 100 x 1 MiB each into 32 MiB of DRAM over a
    512 MiB disk tier (it was: all told stored, 45 dropped undemoted, 76/100 read back)."""
    cfg = store_cfg.with_(capacity_bytes=32 * MB, disk=DiskConfig(tmp_path / "disk", 512 * MB))
    with open_store(cfg) as monitor:
        results = _flood(cfg, 2, 100, MB, 4)
        assert wait_until(lambda: _settled(monitor), 30)
        st = monitor.stats()
        stored = [k for r in results for k, c in zip(r["keys"], r["codes"]) if c == OK]
        refused = [k for r in results for k, c in zip(r["keys"], r["codes"]) if c != OK]
        assert all(c in (OK, ERR_NO_SPACE) for r in results for c in r["codes"])
        assert st["disk_full"] == st["disk_errors"] == 0, st  # the disk had room throughout
        assert st["dram_evictions"] > 0 and st["put_waits"] > 0, st  # it was a flood
        assert st["dropped_undemoted"] == 0, st
        assert st["rejected_puts"] == st["refused_undemoted"] == len(refused), st
        assert len(stored) >= 100, (len(stored), st)  # waiting, most are taken
        exact, missing = _read_back(monitor, stored, MB)  # every one, bit-exact
        assert missing == [] and len(exact) == len(stored)
        assert _read_back(monitor, refused, MB) == ([], refused)  # never visible
        assert st["disk_used_bytes"] <= st["disk_capacity_bytes"]


def test_writer_flood_on_a_full_disk_is_a_dram_cache(store_cfg: StoreConfig,
                                                     tmp_path: Path) -> None:
    """The kernel refuses every disk write (RLIMIT_FSIZE: EFBIG, as ENOSPC would): the tier
    is a DRAM-only cache. Puts are taken without waiting, objects are dropped leaf-first
    as DRAM's eviction does (each counted in dropped_undemoted), and what remains reads
    back bit-exact."""
    cfg = store_cfg.with_(capacity_bytes=32 * MB, disk=DiskConfig(tmp_path / "disk", 512 * MB))
    with open_store(cfg) as monitor:
        pid = monitor.stats()["pid"]
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (DATA_OFFSET + 4096, DATA_OFFSET + 4096))
        results = _flood(cfg, 2, 100, MB, 4)
        assert wait_until(lambda: _settled(monitor), 30)
        st = monitor.stats()
        stored = [k for r in results for k, c in zip(r["keys"], r["codes"]) if c == OK]
        refused = [k for r in results for k, c in zip(r["keys"], r["codes"]) if c != OK]
        assert st["disk_full"] > 0 and st["demotions"] == 0 and st["disk_objects"] == 0, st
        assert refused == [] and st["rejected_puts"] == 0, st
        exact, missing = _read_back(monitor, stored, MB)
        assert len(missing) == st["dropped_undemoted"] > 0, st  # every loss is counted
        assert 0 < len(exact) <= 32 and st["keys"] == len(exact)


@pytest.fixture
def gated(store_cfg: StoreConfig, tmp_path: Path) -> Iterator[Callable[..., StoreConfig]]:
    """Start a coordinator whose disk writes wait until ``tmp_path/gate`` exists; returns
    the config its clients use (no autostart: this one must serve them)."""
    gate = tmp_path / "gate"
    procs: list[subprocess.Popen[bytes]] = []

    def start(dram_mb: int, **disk_kw: Any) -> StoreConfig:
        cfg = store_cfg.with_(capacity_bytes=dram_mb * MB, autostart=False,
                              disk=DiskConfig(tmp_path / "disk", 256 * MB, writers=1, **disk_kw))
        procs.append(subprocess.Popen(
            [sys.executable, str(HELPER), "gated-coordinator", launcher.config_json(cfg),
             str(gate)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True))
        assert wait_until(lambda: launcher.is_running(cfg) or procs[-1].poll() is not None, 30)
        assert procs[-1].poll() is None
        return cfg

    yield start
    gate.touch()  # its I/O threads finish, so it can stop
    for p in procs:
        launcher.stop(store_cfg)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def _put(store: Any, keys: list[str]) -> list[int]:
    data = [payload(k, MB) for k in keys]
    return list(store.batch_put_from(keys, [d.ctypes.data for d in data], [MB] * len(keys),
                                     [None] * len(keys)))


def _in_thread(fn: Callable[[], Any]) -> Callable[[], tuple[Any, float]]:
    """Run ``fn`` in a thread; the returned callable joins it: (result, seconds taken)."""
    out: list[Any] = []
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: out.append((fn(), time.monotonic() - t0)))
    t.start()

    def join() -> tuple[Any, float]:
        t.join(timeout=30)
        assert out, "the call did not return"
        return out[0]  # type: ignore[no-any-return]

    return join


def test_held_reserve_waits_off_the_loop_until_demotion_makes_room(
        gated: Callable[..., StoreConfig], tmp_path: Path) -> None:
    cfg = gated(16, dirty_limit=0.5, put_wait_s=0.5)
    with open_store(cfg) as a, open_store(cfg) as b:
        assert _put(a, [f"a{i}" for i in range(8)]) == [OK] * 8  # 8 MiB: at the bound
        join = _in_thread(lambda: _put(a, ["next"]))
        assert wait_until(lambda: b.stats()["put_waits"] == 1, 5)
        waiting = time.monotonic()  # a's reserve waits from (at the latest) now
        t0 = time.monotonic()
        for _ in range(20):  # every other client is served while a's reserve waits
            assert b.batch_exists([f"a{i}" for i in range(8)]) == 8
            assert b.stats()["pending"] == 0
        assert time.monotonic() - t0 < 0.4
        opened = time.monotonic()
        (tmp_path / "gate").touch()  # the disk catches up: a's reserve gets its room
        codes, took = join()
        # it returned only once the gate opened: it had waited at least since ``waiting``
        assert codes == [OK] and opened - waiting <= took < 0.5, took
        st = b.stats()
        assert st["dropped_undemoted"] == st["rejected_puts"] == 0 and st["put_wait_ms"] > 0
        assert _read_back(b, [f"a{i}" for i in range(8)] + ["next"], MB)[1] == []


def test_held_reserve_is_refused_at_its_deadline_and_a_killed_waiter_is_forgotten(
        gated: Callable[..., StoreConfig], tmp_path: Path) -> None:
    cfg = gated(8, dirty_limit=1.0, put_wait_s=0.2)
    with open_store(cfg) as a, open_store(cfg) as b:
        keys = [f"a{i}" for i in range(8)]
        assert _put(a, keys) == [OK] * 8  # DRAM full, nothing on disk yet
        t0 = time.monotonic()
        assert _put(a, ["late"]) == [ERR_NO_SPACE]
        assert 0.15 <= time.monotonic() - t0 < 2.0
        st = b.stats()
        assert st["refused_undemoted"] == st["rejected_puts"] == 1 and st["pending"] == 0
        assert st["dropped_undemoted"] == 0 and st["keys"] == 8
        assert b.batch_exists(["late"]) == 0 and _read_back(b, ["late"], MB) == ([], ["late"])
        # a writer killed while its reserve waits: its request is dropped with it
        proc = subprocess.Popen([sys.executable, str(HELPER), "flood",
                                 launcher.config_json(cfg), "dead", "2", str(MB), "2"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert wait_until(lambda: b.stats()["put_waits"] == 2, 5)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        (tmp_path / "gate").touch()  # room comes, but not for the dead writer
        assert wait_until(lambda: _settled(b), 10)
        assert _put(b, ["after"]) == [OK]
        st = b.stats()
        assert st["pending"] == 0 and b.batch_exists(["dead/0"]) == 0, st
        assert st["dropped_undemoted"] == 0
        assert _read_back(b, keys + ["after"], MB)[1] == []
