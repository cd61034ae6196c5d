"""The local store's pipelined batches (kvcentric.store.local.client, .rpc): several requests
in flight on one connection, each reply handed to its own request; a batch put sends the next
chunk's reserve before it commits the current chunk, a batch get the next chunk's acquire
before it copies the current one; and what a failure in the middle of a batch leaves."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcentric.config import StoreConfig
from kvcentric.store import ERR_NOT_FOUND, ERR_UNAVAILABLE, OK, StoreUnavailable
from kvcentric.store.local import client as client_mod
from kvcentric.store.local import launcher
from kvcentric.store.local.client import LocalStore, chunks
from kvcentric.store.local.config import DiskConfig
from kvcentric.store.local.rpc import RpcClient

OBJ = 64 << 10
CHUNK = 4 * OBJ  # four objects a chunk: ten objects are three chunks


@pytest.fixture
def store(store_cfg: StoreConfig, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalStore]:
    monkeypatch.setattr(client_mod, "PIPELINE_BYTES", CHUNK)
    s = LocalStore(store_cfg)
    yield s
    s.close()


@pytest.fixture
def sent_ops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every request op the clients of this test send, in order."""
    ops: list[str] = []
    submit, send = RpcClient.submit, RpcClient.send

    def recording_submit(self: RpcClient, op: str, *args: Any, **kw: Any) -> Any:
        ops.append(op)
        return submit(self, op, *args, **kw)

    def recording_send(self: RpcClient, op: str, *args: Any) -> None:
        ops.append(op)
        send(self, op, *args)

    monkeypatch.setattr(RpcClient, "submit", recording_submit)
    monkeypatch.setattr(RpcClient, "send", recording_send)
    return ops


def objects(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, OBJ, dtype=np.uint8) for _ in range(n)]


def put(store: LocalStore, keys: list[str], src: list[np.ndarray]) -> list[int]:
    return store.batch_put_from(keys, [a.ctypes.data for a in src], [OBJ] * len(keys))


def get(store: LocalStore, keys: list[str]) -> tuple[list[int], list[np.ndarray]]:
    dst = [np.zeros(OBJ, np.uint8) for _ in keys]
    return store.batch_get_into(keys, [a.ctypes.data for a in dst], [OBJ] * len(keys)), dst


def test_chunks_cover_the_batch_in_order() -> None:
    assert chunks([OBJ] * 10, CHUNK) == [(0, 4), (4, 8), (8, 10)]
    assert chunks([OBJ] * 8, CHUNK) == [(0, 4), (4, 8)]
    assert chunks([5 * OBJ, OBJ], CHUNK) == [(0, 1), (1, 2)]  # an object over a chunk
    assert chunks([], CHUNK) == [] and chunks([1], CHUNK) == [(0, 1)]


def test_replies_reach_their_requests_whoever_waits_first(store: LocalStore) -> None:
    assert put(store, ["a", "b"], objects(2)) == [OK, OK]
    s = store._link.session
    assert s is not None
    first = s.rpc.submit("exists", ["a", "b"])
    second = s.rpc.submit("exists", ["b", "nope"])
    third = s.rpc.submit("keys", "", 10)
    assert sorted(s.rpc.wait(third)) == ["a", "b"]
    assert first.done and second.done  # read on the way to the third reply
    assert (s.rpc.wait(first), s.rpc.wait(second)) == (2, 1)


def test_a_batch_put_reserves_ahead_and_commits_behind(store: LocalStore,
                                                       sent_ops: list[str]) -> None:
    keys = [f"p/{i}" for i in range(10)]
    src = objects(10)
    sent_ops.clear()
    assert put(store, keys, src) == [OK] * 10
    # chunk 2's reserve leaves before chunk 1's commit, chunk 3's before chunk 2's commit
    assert sent_ops == ["reserve", "reserve", "commit", "reserve", "commit", "commit"]
    codes, dst = get(store, keys)
    assert codes == [OBJ] * 10 and all(np.array_equal(a, b) for a, b in zip(src, dst))


def test_a_batch_get_acquires_ahead_and_stops_at_the_leading_run(store: LocalStore,
                                                                 sent_ops: list[str]) -> None:
    keys = [f"g/{i}" for i in range(10)]
    src = objects(10, seed=1)
    assert put(store, keys[:6], src[:6]) == [OK] * 6
    sent_ops.clear()
    codes, dst = get(store, keys)
    assert codes == [OBJ] * 6 + [ERR_NOT_FOUND] * 4
    assert all(np.array_equal(a, b) for a, b in zip(src[:6], dst[:6]))
    assert not dst[6].any()  # nothing copied past the run
    # chunk 2 was leased short (6 of 8): chunk 3 is never asked for; both leases released
    assert sent_ops == ["acquire", "acquire", "release", "release"]
    assert store.stats()["leases"] == 0  # the releases went before this call, in order


def test_a_coordinator_killed_mid_batch_fails_the_batch_and_leaks_nothing(
        store: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [f"k/{i}" for i in range(10)]
    src = objects(10, seed=2)
    pid = store.stats()["pid"]
    s = store._link.session
    assert s is not None
    arena = s.arena
    held = arena._refs  # the session's own reference
    take = LocalStore._reserve_take
    calls = {"n": 0}

    def killing_take(self: LocalStore, sess: Any, sent: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # chunk 1 committed in flight, chunk 2 reserved: kill it now
            os.kill(pid, signal.SIGKILL)
        return take(self, sess, sent)

    monkeypatch.setattr(LocalStore, "_reserve_take", killing_take)
    codes = put(store, keys, src)
    assert calls["n"] >= 2
    assert codes[4:] == [ERR_UNAVAILABLE] * 6  # chunks 2 and 3 never committed
    assert set(codes[:4]) <= {OK, ERR_UNAVAILABLE}  # chunk 1's commit raced the kill
    assert arena._refs == held - 1  # every slot's reference dropped, and the dead session's
    with pytest.raises(StoreUnavailable):
        store.batch_acquire(keys)  # the breaker is open: no session, no hang


def test_with_a_disk_tier_a_batch_put_is_one_chunk(store_cfg: StoreConfig, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   sent_ops: list[str]) -> None:
    """The coordinator may hold a reserve back for the demoter; a commit queued behind it
    would wait with it, so a disk-tier store gets the batch's reserve, then its commit."""
    monkeypatch.setattr(client_mod, "PIPELINE_BYTES", CHUNK)
    cfg = store_cfg.with_(name=store_cfg.name + "d", disk=DiskConfig(tmp_path / "d", 16 << 20))
    store = LocalStore(cfg)
    try:
        keys = [f"d/{i}" for i in range(10)]
        src = objects(10, seed=3)
        sent_ops.clear()
        assert put(store, keys, src) == [OK] * 10
        assert sent_ops == ["reserve", "commit"]
        codes, dst = get(store, keys)  # gets still pipeline: three chunks, three leases
        assert codes == [OBJ] * 10 and all(np.array_equal(a, b) for a, b in zip(src, dst))
        assert sent_ops[2:] == ["acquire"] * 3 + ["release"] * 3
    finally:
        store.close()
        launcher.stop(cfg)
