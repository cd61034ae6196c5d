"""The local store's shared-memory lookup index: exact leading runs without a round trip."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import Residency, open_store
from kvcentric.store.local import launcher
from kvcentric.store.local.client import LocalStore
from kvcentric.store.local.index import ObjectIndex
from kvcentric.store.local.shared_index import (
    STALE_AFTER_MS,
    SharedIndexReader,
    SharedIndexWriter,
    fingerprint,
    slots_for,
)
from kvcentric.testing.signals import sigstop
from tests.helpers.waiting import wait_until
from tests.store.store_contract import StoreContract, put
from tests.store.test_store_local import as_dict


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[SharedIndexWriter, SharedIndexReader]]:
    w = SharedIndexWriter(tmp_path / "x.index", 64)
    r = SharedIndexReader(tmp_path / "x.index")
    yield w, r
    r.close()
    w.close()


def _present(r: SharedIndexReader, key: str) -> bool:
    return r.leading_run([key]) == 1


def test_table_matches_a_set_under_random_inserts_and_deletes(
        pair: tuple[SharedIndexWriter, SharedIndexReader]) -> None:
    """64 slots, up to 32 live: long probe runs that wrap around the end of the table,
    so every case of backward-shift deletion happens."""
    w, r = pair
    rng = random.Random(7)
    universe = [f"k{i}" for i in range(80)]
    live: set[str] = set()
    for step in range(4000):
        key = rng.choice(universe)
        with w.write():
            if key in live:
                w.delete(key)
                live.discard(key)
            elif len(live) < 32:
                w.put(key, 0, True, None)
                live.add(key)
        if step % 50 == 0:
            assert {k for k in universe if _present(r, k)} == live
    assert {k for k in universe if _present(r, k)} == live


def test_full_table_disables_itself_and_readers_fall_back(
        pair: tuple[SharedIndexWriter, SharedIndexReader]) -> None:
    w, r = pair
    with w.write():
        for i in range(33):  # one more than half of 64 slots
            w.put(f"k{i}", 0, True, None)
    assert not w.enabled and w.disabled_reason
    assert r.leading_run(["k0"]) is None


def test_reader_never_reads_through_a_write_section(
        pair: tuple[SharedIndexWriter, SharedIndexReader]) -> None:
    w, r = pair
    with w.write():
        w.put("a", 0, True, None)
        assert r.leading_run(["a"]) is None  # seqlock odd: the caller asks the coordinator
    assert r.leading_run(["a"]) == 1


def test_bad_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "junk").write_bytes(os.urandom(200))
    with pytest.raises(ValueError, match="not a kvcentric shared index"):
        SharedIndexReader(tmp_path / "junk")
    with pytest.raises(ValueError, match="power of two"):
        SharedIndexWriter(tmp_path / "y", 100)
    assert slots_for(64 << 20) == 8192 and slots_for(1 << 50) == 1 << 22
    assert fingerprint("a") & 1 and fingerprint("a") != fingerprint("b")


def _chain(tag: str, n: int) -> list[str]:
    return [f"{tag}/{i:04d}" for i in range(n)]


def _commit(idx: ObjectIndex, keys: list[str], parents: list[str | None]) -> None:
    for k, p in zip(keys, parents):
        assert idx.reserve(k, 64, p, owner=1) >= 0
    for k in keys:
        assert idx.commit(k, 1, None) == 0


class _Both:
    """An ObjectIndex publishing into a shared index, and a reader of it."""

    def __init__(self, tmp_path: Path, capacity: int) -> None:
        self.w = SharedIndexWriter(tmp_path / "t.index", 4096)
        self.idx = ObjectIndex(capacity, self.w)
        self.r = SharedIndexReader(tmp_path / "t.index")

    def check(self, keys: list[str]) -> None:
        """Every prefix and every suffix of the chain (the router looks up suffixes)."""
        for n in range(len(keys) + 1):
            for part in (keys[:n], keys[n:]):
                assert self.r.leading_run(part) == self.idx.leading_run(part), part


def test_leading_runs_equal_the_coordinators_in_every_shape(tmp_path: Path) -> None:
    """Chains with parents, chains without, children committed before their parents,
    inner objects removed and put back, and eviction: the shared answer is the
    coordinator's answer for every prefix of every chain."""
    b = _Both(tmp_path, capacity=64 * 1000)
    a = _chain("a", 40)
    with b.w.write():
        _commit(b.idx, a, [None, *a[:-1]])  # a linked chain
    b.check(a)
    flat = _chain("f", 10)
    with b.w.write():
        _commit(b.idx, flat, [None] * 10)  # no parents: every object a root
    b.check(flat)
    o = _chain("o", 12)
    with b.w.write():
        _commit(b.idx, o[6:], o[5:-1])  # children first: orphans
    b.check(o)
    with b.w.write():
        _commit(b.idx, o[:6], [None, *o[:5]])  # the parents arrive: orphans are linked
    b.check(o)
    assert b.idx.entries[o[-1]].complete and b.idx.entries[o[-1]].depth == 11
    with b.w.write():
        assert b.idx.remove(a[20]) == 0  # a hole inside a linked chain
    b.check(a)
    assert b.r.leading_run(a) == 20
    with b.w.write():
        _commit(b.idx, [a[20]], [a[19]])  # put back: the subtree below is whole again
    b.check(a)
    assert b.r.leading_run(a) == 40
    c = _chain("c", 2000)
    with b.w.write():
        for i in range(0, 2000, 100):  # 128 KB of chains into a 64 KB arena: eviction
            _commit(b.idx, c[i:i + 100], [c[i - 1] if i else None, *c[i:i + 99]])
    assert b.idx.counters.evictions > 0
    for chain in (a, flat, o, c):
        b.check(chain)
    b.r.close()
    b.w.close()


def test_lookups_answer_from_shared_memory(store_cfg: StoreConfig) -> None:
    """The coordinator counts socket lookups; shared ones never reach it."""
    with open_store(store_cfg) as s:
        keys = [f"k{i}" for i in range(64)]
        put(s, keys, [None, *keys[:-1]])
        before = s.stats()["lookups"]
        assert [s.batch_exists(keys[:n]) for n in (64, 10, 0)] == [64, 10, 0]
        assert s.batch_exists([*keys[:5], "nope"]) == 5
        assert s.batch_exists(keys[7:]) == 57  # a chain that starts mid-way
        # what the router asks on its event loop: the same answers, no call either
        assert [s.residency_nowait(keys[:n]) for n in (64, 10, 0)] == [
            Residency(64), Residency(10), Residency(0)]
        assert s.residency_nowait([*keys[:5], "nope"]) == Residency(5)
        assert s.stats()["lookups"] == before and s.stats()["shared_index"] == 1
    with open_store(store_cfg.with_(shared_index=False)) as s:
        assert s.residency_nowait(keys) is None  # only a call can answer
        assert s.batch_exists(keys) == 64
        assert s.stats()["lookups"] == before + 1


def test_hung_coordinator_turns_lookups_into_misses(store_cfg: StoreConfig) -> None:
    """SIGSTOP the coordinator: within the heartbeat window plus one op timeout, lookups
    answer 0 (the engine recomputes) instead of trusting a frozen index; SIGCONT and a
    reconnect bring the shared answers back."""
    cfg = store_cfg.with_(op_timeout_s=1.0, reconnect_interval_s=0.2)
    s = open_store(cfg)
    keys = [f"k{i}" for i in range(8)]
    put(s, keys, [None, *keys[:-1]])
    pid = s.stats()["pid"]
    sigstop(pid)
    try:
        # wait for the heartbeat to go stale (the shared index declines to answer), not
        # for a guess of when it has
        index = s._link.session.index if s._link.session else None
        assert index is not None and index.leading_run(keys) == 8
        assert wait_until(lambda: index.leading_run(keys) is None, STALE_AFTER_MS / 1000 + 10)
        assert s.residency_nowait(keys) is None  # a frozen index answers nothing
        t0 = time.monotonic()
        assert s.batch_exists(keys) == 0
        assert time.monotonic() - t0 < 3.0
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while s.batch_exists(keys) != 8 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert s.batch_exists(keys) == 8
    s.close()


def test_killed_coordinator_is_not_trusted(store_cfg: StoreConfig) -> None:
    s = open_store(store_cfg.with_(reconnect_interval_s=0.1))
    put(s, ["a", "b"], [None, "a"])
    pid = s.stats()["pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not launcher.pid_alive(pid), 10)  # it is dead
    assert s.residency_nowait(["a", "b"]) is None
    assert s.batch_exists(["a", "b"]) == 0  # a restarted store is empty
    s.close()


CHURN = """
import json, sys, numpy as np
from kvcentric.store import open_store
cfg = json.loads(sys.argv[1]); n = int(sys.argv[2])
s = open_store(cfg); buf = np.zeros(1 << 14, np.uint8)
for r in range(n):
    keys = [f"c{r}/{i}" for i in range(16)]
    s.batch_put_from(keys, [buf.ctypes.data] * 16, [buf.nbytes] * 16, [None, *keys[:-1]])
"""

LOOKER = """
import json, sys, time
from kvcentric.store import open_store
cfg = json.loads(sys.argv[1]); s = open_store(cfg)
fixed = [f"fixed/{i}" for i in range(32)]
end = time.monotonic() + float(sys.argv[2]); n = 0
while time.monotonic() < end:
    assert s.batch_exists(fixed) == 32
    for r in range(0, 400, 37):
        got = s.batch_exists([f"c{r}/{i}" for i in range(16)])
        assert 0 <= got <= 16, got
    n += 1
print(n)
"""


def test_lookups_stay_exact_while_the_coordinator_churns(store_cfg: StoreConfig) -> None:
    """Three processes look up while another writes 400 chains of 256 KiB into a 12 MiB
    store (eviction all along): a leased chain is always whole, churned ones in range."""
    cfg = store_cfg.with_(capacity_bytes=12 << 20)
    d = as_dict(cfg)
    with open_store(cfg) as s:
        fixed = [f"fixed/{i}" for i in range(32)]
        put(s, fixed, [None, *fixed[:-1]])
        lease = s.batch_acquire(fixed)  # pinned: eviction must skip it
        lookers = [subprocess.Popen([sys.executable, "-c", LOOKER, json.dumps(d), "6"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for _ in range(3)]
        churn = subprocess.run([sys.executable, "-c", CHURN, json.dumps(d), "400"],
                               capture_output=True, text=True, timeout=120)
        assert churn.returncode == 0, churn.stderr
        for p in lookers:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0 and int(out) > 0, err
        assert s.stats()["evictions"] > 0
        s.release(lease)


@pytest.fixture
def socket_lookups(store_cfg: StoreConfig) -> Iterator[LocalStore]:
    s = open_store(store_cfg.with_(shared_index=False))
    assert isinstance(s, LocalStore)
    yield s
    s.close()


class TestContractWithSocketLookups(StoreContract):
    """The whole store contract again with lookups answered by the coordinator."""

    @pytest.fixture
    def store(self, socket_lookups: LocalStore) -> LocalStore:
        return socket_lookups

    @pytest.fixture
    def store_config(self, store_cfg: StoreConfig) -> dict[str, object]:
        return as_dict(store_cfg) | {"shared_index": False}
