"""The mooncake backend against a real ``mooncake_master`` in a private network namespace:
checksums, processes sharing KV through a storage node, the service commands, and faults
(master killed and restarted, storage node killed, store full), in make test's serial
pass. The KVStore contract: tests/store/test_store_mooncake_contract.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcentric.store import (
    ERR_CORRUPT,
    ERR_NO_SPACE,
    ERR_UNAVAILABLE,
    OK,
    StoreUnavailable,
    open_store,
)
from kvcentric.testing.netns import unavailable_reason
from tests.helpers.mooncake_cluster import (
    ROOT,
    MooncakeCluster,
    clean_env,
    end,
    module_cluster_fixtures,
)
from tests.helpers.payload import payload, size_of
from tests.helpers.waiting import wait_until
from tests.store.store_contract import WORKER, get, put

pytest.importorskip("mooncake.store", reason="the Mooncake wheel is not installed")
_NO_NETNS = unavailable_reason()
pytestmark = [pytest.mark.mooncake, pytest.mark.serial,
              pytest.mark.skipif(_NO_NETNS is not None, reason=f"no netns: {_NO_NETNS}")]
LOAD = ROOT / "tests" / "helpers" / "mooncake_load.py"


mc, _in_netns = module_cluster_fixtures("mooncake")


def spawn(c: MooncakeCluster, cmd: list[str], **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(c.ns.wrap(cmd), env=clean_env(), text=True,
                            start_new_session=True, **kw)


def worker(c: MooncakeCluster, cfg: dict[str, Any], *args: str) -> Any:
    p = spawn(c, [sys.executable, str(WORKER), json.dumps(cfg), *args],
              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def test_checksums_catch_corrupted_and_unchecked_objects(mc: MooncakeCluster) -> None:
    """Bytes changed inside the store (a raw client swaps in the object with one byte
    flipped and the original trailer) are caught on every read path, and an object written
    without a checksum is never served to a checking client."""
    checked = open_store(mc.store_config(global_segment_size="32mb") | {"verify_checksums": True})
    raw = open_store(mc.store_config() | {"verify_checksums": False})
    try:
        n = size_of("cs/0")
        assert put(checked, ["cs/0"]) == [OK]
        stored = np.zeros(n + 8, np.uint8)
        assert raw.batch_get_into(["cs/0"], [stored.ctypes.data], [stored.nbytes]) == [n + 8]
        assert np.array_equal(stored[:n], payload("cs/0", n))  # object, then its trailer
        assert get(checked, ["cs/0"])[0] is not None
        stored[n // 2] ^= 0xFF
        assert raw.remove("cs/0", force=True) == OK
        assert raw.batch_put_from(["cs/0"], [stored.ctypes.data], [stored.nbytes]) == [OK]
        dst = np.zeros(n, np.uint8)
        assert checked.batch_get_into(["cs/0"], [dst.ctypes.data], [n]) == [ERR_CORRUPT]
        lease = checked.batch_acquire(["cs/0"], [n])
        assert lease.keys == []  # nothing leased, nothing handed out
        checked.release(lease)
        assert put(raw, ["cs/1"]) == [OK]  # no trailer
        assert get(checked, ["cs/1"]) == [None]
        assert checked.stats()["corrupt"] >= 2  # cs/1 fails as a length mismatch
    finally:
        checked.close()
        raw.close()


def test_two_pure_clients_share_kv_through_a_storage_node(mc: MooncakeCluster) -> None:
    mc.start_node("shared", "64mb")
    try:
        cfg = mc.store_config()  # pure clients: neither contributes memory
        keys = [f"share/{i}" for i in range(12)]
        assert worker(mc, cfg, "put", *keys) == [OK] * 12
        assert worker(mc, cfg, "get", *keys) == {"got": 12, "bad": 0}
        with open_store(cfg) as s:
            st = s.stats()
            assert st["capacity_bytes"] == 64 << 20 and st["keys"] >= 12
            # a second put of the same keys skips them: nothing is transferred again
            assert put(s, keys[:4]) == [OK] * 4 and s.stats()["skipped_puts"] == 4
    finally:
        mc.kill_node("shared", signal.SIGTERM)


def test_storage_node_killed_reads_fail_never_wrong(mc: MooncakeCluster) -> None:
    mc.start_node("doomed", "32mb")
    with open_store(mc.store_config()) as s:
        keys = [f"doomed/{i}" for i in range(6)]
        assert put(s, keys) == [OK] * 6
        mc.kill_node("doomed")
        # reads fail at once (transfer error); the master drops the dead node's objects
        # from its index after its client TTL (the cluster's client_ttl_s); until then they "exist"
        deadline = time.monotonic() + 40
        while True:
            for k, b in zip(keys, get(s, keys)):
                assert b is None, f"{k}: read from a dead node"
            if s.batch_exists(keys) == 0:
                break
            assert time.monotonic() < deadline, "the master never dropped the dead node"
            time.sleep(0.5)
        assert s.stats()["capacity_bytes"] == 0 and put(s, ["after"]) == [ERR_NO_SPACE]


def test_storage_node_killed_mid_streamed_lease_fails_the_range(mc: MooncakeCluster) -> None:
    """A layer-wise load whose node dies between two ranges gets an error for the second
    range (so the connector recomputes), never stale or foreign bytes. Ranged reads are
    the unchecked path (a checksum needs the whole object, so a checked lease is read
    whole when it is made)."""
    mc.start_node("midway", "32mb")
    size = 64 << 10
    with open_store(mc.store_config() | {"verify_checksums": False}) as s:
        keys = [f"midway/{i}" for i in range(4)]
        data = [payload(k, size) for k in keys]
        assert s.batch_put_from(keys, [d.ctypes.data for d in data], [size] * 4) == [OK] * 4
        lease = s.batch_acquire_streamed(keys, [size] * 4)
        try:
            assert lease.keys == keys
            s.fetch_range(lease, 0, size // 2)
            mc.kill_node("midway")
            with pytest.raises(StoreUnavailable):
                s.fetch_range(lease, size // 2, size // 2)
        finally:
            s.release(lease)
        # a ranged get to the dead node that overran its bound (a loaded machine) was
        # abandoned: its staging is held until Mooncake's call returns, then given back
        if s.stats()["abandoned_calls"]:
            assert wait_until(lambda: s.stats()["staging_used_bytes"] == 0, 60)
        else:
            assert s.stats()["staging_used_bytes"] == 0
        # later tests need a pool without the dead segment: the master drops it after the
        # node's client TTL
        deadline = time.monotonic() + 40
        while s.batch_exists(keys[:1]):
            assert time.monotonic() < deadline, "the master never dropped the dead node"
            time.sleep(0.5)


def test_full_store_refuses_puts_cleanly(mc: MooncakeCluster) -> None:
    """A put larger than the pool is refused as no space, at once. The pool must be this
    client's 16 MiB alone: a segment of an earlier test's client stays in the master's
    pool until its client TTL lapses, and a put placed there fails its transfer (to a
    process that is gone) instead: wait for the master to drop them first."""
    with open_store(mc.store_config(global_segment_size="16mb", no_space_wait_s=0.3)) as s:
        s.clear()  # type: ignore[attr-defined]
        assert wait_until(lambda: s.stats()["capacity_bytes"] == 16 << 20,
                          3 * mc.client_ttl_s), s.stats()
        big = np.zeros(24 << 20, np.uint8)
        s.register_buffer(big.ctypes.data, big.nbytes)
        t0 = time.monotonic()
        assert s.batch_put_from(["big"], [big.ctypes.data], [big.nbytes]) == [ERR_NO_SPACE]
        assert time.monotonic() - t0 < 2.0
        slots = s.batch_alloc(["big2"], [big.nbytes])
        assert s.batch_commit([x for x in slots if x]) == [ERR_NO_SPACE]
        st = s.stats()
        assert st["rejected_puts"] == 2 and st["used_bytes"] <= st["capacity_bytes"]
        assert put(s, ["small"]) == [OK] and s.health_check()


def test_master_killed_calls_fail_fast_then_recover(mc: MooncakeCluster) -> None:
    """The load's own rounds mark each phase (tests/helpers/mooncake_load.py prints ok or
    fail per round): steady, then the master is killed until the load has seen the
    outage for a few rounds, then a fresh master until it succeeds again."""
    mc.start_node("steady", "64mb")
    load = spawn(mc, [sys.executable, str(LOAD), json.dumps(mc.store_config()), "300"],
                 stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    lines: list[str] = []
    try:
        assert load.stdout is not None and load.stdout.readline().strip() == "ready"
        threading.Thread(target=lambda: lines.extend(ln.strip() for ln in load.stdout or ()),
                         daemon=True).start()
        assert wait_until(lambda: lines.count("ok") >= 20, 60), lines[-5:]  # steady
        mc.kill_master()
        assert wait_until(lambda: lines.count("fail") >= 5, 60), lines[-5:]  # seen, lasting
        mc.start_master()  # a fresh master: empty, the node remounts its segment
        n = len(lines)
        assert wait_until(lambda: "ok" in lines[n:], 60), lines[-5:]  # it recovered
        assert load.stdin is not None
        load.stdin.close()  # the load ends its round and reports
        load.wait(timeout=60)
        assert wait_until(lambda: bool(lines) and lines[-1].startswith("{"), 10)
    finally:
        end(load, signal.SIGKILL)
        mc.kill_node("steady", signal.SIGTERM)
    res = json.loads(lines[-1])
    assert res["bad"] == 0, res
    assert res["codes"].get(str(ERR_UNAVAILABLE), 0) > 0, res  # the outage was seen
    assert res["slowest_s"] < 6.0, res  # at most one Mooncake reconnect stall, no hang
    assert res["first_ok_after_fail_s"] is not None, res  # and it recovered
    assert res["codes"]["ok"] > 0


def test_calls_while_master_is_down_cost_microseconds(mc: MooncakeCluster) -> None:
    s = open_store(mc.store_config(global_segment_size="16mb"))
    try:
        assert put(s, ["before"]) == [OK]
        mc.kill_master()
        deadline = time.monotonic() + 5
        while s.health_check() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not s.health_check()  # the monitor noticed within its probe interval
        t0 = time.monotonic()
        for _ in range(100):
            assert s.batch_exists(["before"]) == 0
            assert get(s, ["before"]) == [None]
            assert put(s, ["during"]) == [ERR_UNAVAILABLE]
        assert time.monotonic() - t0 < 0.5
        with pytest.raises(Exception, match="unreachable"):
            s.batch_acquire(["before"], [size_of("before")])
        mc.start_master()
        deadline = time.monotonic() + 20
        while not (s.health_check() and put(s, ["after"]) == [OK]):
            assert time.monotonic() < deadline, "the client did not reconnect"
            time.sleep(0.2)
        assert s.batch_exists(["after"]) == 1 and s.stats()["outages"] == 1
    finally:
        s.close()


@pytest.mark.parametrize("segment", ["0", "16mb"])
def test_client_opened_before_the_master_joins_when_it_starts(mc: MooncakeCluster,
                                                             segment: str) -> None:
    """Engines may start before the store: the client fails fast, then joins."""
    mc.kill_master()
    t0 = time.monotonic()
    s = open_store(mc.store_config(global_segment_size=segment))
    try:
        assert time.monotonic() - t0 < 5 and not s.health_check()
        assert put(s, ["early"]) == [ERR_UNAVAILABLE] and s.batch_exists(["early"]) == 0
        mc.start_master()
        if segment == "0":
            mc.start_node("late", "16mb")
        deadline = time.monotonic() + 30
        while (codes := put(s, ["late"])) != [OK]:
            assert time.monotonic() < deadline, f"the client never joined: {codes}"
            time.sleep(0.2)
        assert s.health_check() and s.stats()["capacity_bytes"] == 16 << 20
    finally:
        s.close()
        mc.kill_node("late", signal.SIGTERM)


def test_cli_master_with_http_metadata_and_node(mc: MooncakeCluster, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``mooncake-master`` (metadata server on) and ``mooncake-node`` as users run them."""
    c = MooncakeCluster(tmp_path, http_metadata=True, ns=mc.ns, port_offset=10)
    monkeypatch.delenv("MC_TCP_BIND_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="MC_TCP_BIND_ADDRESS=127.0.0.1"):
        open_store(c.store_config())  # kvcentric never writes os.environ: the user sets it
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    base = [sys.executable, "-m", "kvcentric.store.mooncake.service"]
    master = spawn(c, base + ["mooncake-master", "--port", str(c.rpc_port), "--metrics-port",
                              str(c.metrics_port), "--metadata-port", str(c.metadata_port),
                              "--log", str(tmp_path / "m.log")], stdout=subprocess.PIPE)
    try:
        assert master.stdout is not None
        line = master.stdout.readline()
        assert f"metadata_server {c.metadata_server}" in line, line
        c.start_node("n", "16mb")
        with open_store(c.store_config()) as s:
            assert put(s, ["via-http-metadata"]) == [OK]
            assert s.stats()["capacity_bytes"] == 16 << 20
            (b,) = get(s, ["via-http-metadata"])
            assert b is not None and np.array_equal(b, payload("via-http-metadata", b.nbytes))
        c.kill_node("n", signal.SIGTERM)
        master.send_signal(signal.SIGTERM)
        assert master.wait(timeout=20) == 0
    finally:
        end(master, signal.SIGKILL)
        c.stop()


def test_soft_pinned_handoff_outlives_eviction_pressure(mc: MooncakeCluster) -> None:
    """A P/D prefill's objects (committed with ``pin_s``) carry Mooncake's soft pin: the
    master evicts every unpinned object before them."""
    with open_store(mc.store_config(global_segment_size="32mb", no_space_wait_s=2.0)) as s:
        s.clear()  # type: ignore[attr-defined]
        obj = 4 << 20

        def commit(keys: list[str], pin_s: float) -> list[int]:
            slots = [x for x in s.batch_alloc(keys, [obj] * len(keys)) if x is not None]
            return s.batch_commit(slots, pin_s)

        assert commit(["pin-0", "pin-1"], 60.0) == [OK, OK]
        for i in range(24):  # three times the pool: the master keeps evicting
            commit([f"flood-{i}"], 0.0)
        assert s.batch_exists(["pin-0", "pin-1"]) == 2


def _metric(c: MooncakeCluster, name: str) -> float:
    import httpx
    text = httpx.get(f"http://127.0.0.1:{c.metrics_port}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the master's metrics")


def test_cli_ssd_offload_serves_what_memory_evicted(mc: MooncakeCluster, tmp_path: Path) -> None:
    """``mooncake-master --offload`` + ``mooncake-node --ssd-offload-path`` as users run
    them: objects written past the 16 MiB segment (twice over) reach the node's SSD
    directory, and the ones memory evicted are served from there, byte for byte."""
    c = MooncakeCluster(tmp_path, ns=mc.ns, port_offset=20)
    base = [sys.executable, "-m", "kvcentric.store.mooncake.service"]
    master = spawn(c, base + ["mooncake-master", "--offload", "--lease-ttl-ms", "500",
                              "--port", str(c.rpc_port), "--metrics-port", str(c.metrics_port),
                              "--metadata-port", "0", "--log", str(tmp_path / "m.log")],
                   stdout=subprocess.PIPE)
    assert master.stdout is not None
    master.stdout.readline()  # up (it prints its addresses)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    node = spawn(c, base + ["mooncake-node", "--segment", "16mb", "--master",
                            f"127.0.0.1:{c.rpc_port}", "--metadata", c.metadata_server,
                            "--ssd-offload-path", str(ssd)], stdout=subprocess.PIPE,
                 stderr=open(tmp_path / "node.log", "ab"))
    try:
        assert node.stdout is not None
        line = node.stdout.readline()
        assert "mooncake node ready" in line, (tmp_path / "node.log").read_text()[-2000:]
        assert _metric(c, "master_total_file_capacity_bytes") > 0  # a disk segment mounted
        with open_store(c.store_config()) as s:
            keys = [f"offload-{i}" for i in range(200)]  # ~2x the segment
            for k in keys:  # between two offload heartbeats a full segment refuses puts
                deadline = time.monotonic() + 15
                while (codes := put(s, [k])) != [OK]:
                    assert codes == [ERR_NO_SPACE] and time.monotonic() < deadline, codes
                    time.sleep(0.05)
            assert any(p.suffix == ".bucket" for p in ssd.iterdir())
            assert _metric(c, "master_allocated_file_size_bytes") > 0
            got = get(s, keys[:40])  # the oldest: evicted from memory, kept on disk
            for k, b in zip(keys[:40], got):
                assert b is not None and np.array_equal(b, payload(k, b.nbytes)), k
            assert s.stats()["capacity_bytes"] == 16 << 20
    finally:
        end(node, signal.SIGTERM)
        end(master, signal.SIGTERM)
