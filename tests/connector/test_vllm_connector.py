"""The vLLM connector end to end, on real vLLM CPU server processes and a real local store.

Servers (tiny model, float32 so greedy tokens are comparable across processes):
``base`` has no connector (the reference tokens: the session's shared plain engine);
``a`` and ``b`` are kv_both on store X.
``a`` writes checksums and prefills in chunks of 512 tokens, so its blocks are saved over
several steps (chunked prefill); more servers are started by the tests that need them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcentric.config import StoreConfig
from kvcentric.hashing import block_hashes, hash_seed
from kvcentric.integrity import HEADER_BYTES
from kvcentric.store import open_store
from kvcentric.store.local import launcher
from kvcentric.store.local.client import LocalStore
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import VllmServer, connector_config
from tests.helpers.e2e_store import e2e_store
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.vllm
STORED_BLOCK = 128  # the default stored block on CPU: one 128-token page


def prompt(seed: int, n: int = 1100) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(4, 4000) for _ in range(n)]


def start_all(*servers: VllmServer) -> None:
    for s in servers:
        s.start()
    for s in servers:
        s.wait_ready()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_model("tiny", Path.cwd() / ".models" / "tiny"))


@pytest.fixture(scope="module")
def store_x(runtime_dir: Path) -> Iterator[dict[str, Any]]:
    cfg = e2e_store("vllm-x", "512mb", runtime_dir)
    yield cfg
    launcher.stop(StoreConfig.from_dict(cfg))


@pytest.fixture(scope="module")
def servers(tiny_model: str, store_x: dict[str, Any], plain_tiny: VllmServer,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmServer]]:
    """``base``: the session's plain engine (tests/helpers/engines.py; its answers only);
    ``a`` and ``b``: this module's, shared by all its tests, which therefore count their
    metrics as differences and reset ``b``'s prefix cache before a load they count.

    A test starts an engine of its own where it needs a configuration ``a`` and ``b`` lack
    or counters from zero: a checksum-verifying ``kv_consumer`` (the corruption test),
    a producer and a consumer whose totals are exact (disaggregation), an engine on a small
    store of its own (full store), another dtype and another ``model_id`` (isolation), and
    engines on a store that cannot start (unstartable store)."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    own = {
        "a": VllmServer(tiny_model, log_path=logs / "a.log",
                        args=("--max-num-batched-tokens", "512"),
                        kv_transfer=connector_config(store_x | {"verify_checksums": True})),
        "b": VllmServer(tiny_model, log_path=logs / "b.log",
                        kv_transfer=connector_config(store_x)),
    }
    try:
        start_all(*own.values())
        yield {"base": plain_tiny, **own}
    finally:
        for s in own.values():
            s.stop()


def hits(server: VllmServer) -> float:
    return server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)


def test_reuse_across_processes(servers: dict[str, VllmServer]) -> None:
    p = prompt(1)
    want = servers["base"].tokens(p)
    assert servers["a"].tokens(p) == want
    before = hits(servers["b"])
    assert servers["b"].tokens(p) == want
    m = servers["b"].metrics()
    # every full block and the tail a stored: all but the last token are loaded
    assert m["vllm:external_prefix_cache_hits_total"] - before == len(p) - 1
    assert m["vllm:kvcentric_loaded_blocks_total"] >= len(p) // STORED_BLOCK + 1
    assert m["vllm:kvcentric_tail_hits_total"] >= 1


def _corrupt(store_cfg: dict[str, Any], p: list[int], header: bool = False) -> int:
    """Overwrite every stored object of prompt ``p`` with random bytes: its payload (the
    header still names the object), or with ``header`` its header region; returns how
    many objects."""
    hexes = {h.hex() for h in block_hashes(p, STORED_BLOCK, hash_seed("tiny"))}
    store = open_store(store_cfg)
    assert isinstance(store, LocalStore)
    try:
        keys = [k for k in store.list_keys("kvc/v2/tiny/") if k.rsplit("/", 1)[1] in hexes]
        lease = store.batch_acquire(keys)
        rng = np.random.default_rng(0)
        for ptr, size in zip(lease.ptrs, lease.sizes):
            start, end = (0, HEADER_BYTES) if header else (HEADER_BYTES, size)
            view = store.arena_view(ptr, size)
            view[start:end] = rng.integers(0, 256, end - start, np.uint8).tobytes()
        store.release(lease)
        return len(lease.ptrs)
    finally:
        store.close()


def test_corruption_is_used_then_caught_by_checksums(
        servers: dict[str, VllmServer], store_x: dict[str, Any], tiny_model: str,
        tmp_path: Path) -> None:
    p = prompt(2)
    want = servers["base"].tokens(p)
    assert servers["a"].tokens(p) == want  # a stores p, with checksums
    assert _corrupt(store_x, p) == (len(p) - 1) // STORED_BLOCK
    # b trusts the payload (checksums off, headers intact): the corrupted KV is really
    # used, so its tokens change
    servers["b"].reset_prefix_cache()
    before = hits(servers["b"])
    assert servers["b"].tokens(p) != want
    assert hits(servers["b"]) - before == len(p) - 1
    # a reader that verifies checksums detects it, reports it and recomputes
    checker = VllmServer(tiny_model, log_path=tmp_path / "checker.log",
                         kv_transfer=connector_config(store_x | {"verify_checksums": True},
                                                      role="kv_consumer"))
    try:
        start_all(checker)
        assert checker.tokens(p) == want
        assert checker.metrics()["vllm:kvcentric_load_errors_total"] >= 1
    finally:
        checker.stop()


def test_a_damaged_header_is_always_caught(servers: dict[str, VllmServer],
                                           store_x: dict[str, Any]) -> None:
    """The integrity header is checked by every reader, checksums or not: objects whose
    headers no longer name them are never unpacked; the engine recomputes, same tokens."""
    p = prompt(8)
    want = servers["base"].tokens(p)
    assert servers["a"].tokens(p) == want
    assert _corrupt(store_x, p, header=True) == (len(p) - 1) // STORED_BLOCK
    b = servers["b"]
    b.reset_prefix_cache()
    before = b.metrics()
    assert b.tokens(p) == want
    after = b.metrics()
    assert after["vllm:kvcentric_integrity_errors_total"] - before.get(
        "vllm:kvcentric_integrity_errors_total", 0.0) >= 1
    assert after["vllm:kvcentric_load_errors_total"] > before.get(
        "vllm:kvcentric_load_errors_total", 0.0)


def test_prefill_decode_disaggregation(servers: dict[str, VllmServer], store_x: dict[str, Any],
                                       tiny_model: str, tmp_path: Path) -> None:
    p = prompt(3)
    want = servers["base"].tokens(p, max_tokens=24)
    prod = VllmServer(tiny_model, log_path=tmp_path / "p.log",
                      kv_transfer=connector_config(store_x, role="kv_producer"))
    cons = VllmServer(tiny_model, log_path=tmp_path / "d.log",
                      kv_transfer=connector_config(store_x, role="kv_consumer"))
    try:
        start_all(prod, cons)
        prod.tokens(p, max_tokens=1)  # prefill only: its KV, tail included, goes to the store
        assert prod.metrics()["vllm:kvcentric_saved_tails_total"] == 1
        assert cons.tokens(p, max_tokens=24) == want
        m = cons.metrics()
        # the decode instance loads all but the last prompt token and computes that one
        assert m["vllm:external_prefix_cache_hits_total"] == len(p) - 1
        assert m["vllm:prompt_tokens_total"] - m["vllm:external_prefix_cache_hits_total"] \
            - m.get("vllm:prefix_cache_hits_total", 0.0) == 1
        assert prod.metrics()["vllm:kvcentric_loaded_blocks_total"] == 0  # producers never load
    finally:
        prod.stop()
        cons.stop()


def test_full_store_never_fails_requests(servers: dict[str, VllmServer], tiny_model: str,
                                         runtime_dir: Path, tmp_path: Path) -> None:
    small = e2e_store("vllm-small", "2500kb", runtime_dir)
    srv = VllmServer(tiny_model, log_path=tmp_path / "small.log",
                     kv_transfer=connector_config(small))
    try:
        start_all(srv)
        prompts = [prompt(100 + i) for i in range(4)]
        for p in prompts:  # 8 objects of 512 KiB per prompt, 4 fit
            assert srv.tokens(p) == servers["base"].tokens(p)
        with open_store(small) as st:
            stats = st.stats()
        assert stats["used_bytes"] <= stats["capacity_bytes"]
        assert stats["evictions"] + stats["rejected_puts"] > 0
    finally:
        srv.stop()
        launcher.stop(StoreConfig.from_dict(small))


def test_isolation_by_model_dtype_and_salt(servers: dict[str, VllmServer],
                                           store_x: dict[str, Any], tiny_model: str,
                                           tmp_path: Path) -> None:
    p = prompt(5)
    servers["a"].tokens(p)  # stored under model "tiny", float32, no salt
    other_dtype = VllmServer(tiny_model, dtype="bfloat16", log_path=tmp_path / "bf16.log",
                             kv_transfer=connector_config(store_x))
    other_model = VllmServer(tiny_model, log_path=tmp_path / "m2.log",
                             kv_transfer=connector_config(store_x, model_id="tiny-v2"))
    try:
        start_all(other_dtype, other_model)
        for srv in (other_dtype, other_model):
            srv.tokens(p)
            m = srv.metrics()
            assert m["vllm:kvcentric_lookups_total"] >= 1 and hits(srv) == 0
    finally:
        other_dtype.stop()
        other_model.stop()
    # a tenant's salt: b gets no hit on a's unsalted KV, then hits a's salted KV
    b = servers["b"]
    before = hits(b)
    b.tokens(p, cache_salt="tenant-1")
    assert hits(b) == before
    q = prompt(6)
    servers["a"].tokens(q, cache_salt="tenant-2")
    b.tokens(q)
    assert hits(b) == before
    b.tokens(q, cache_salt="tenant-2")
    assert hits(b) > before


def test_concurrent_overlapping_prefixes(servers: dict[str, VllmServer]) -> None:
    shared = [prompt(200 + g, 600) for g in range(4)]
    prompts = [shared[i % 4] + prompt(300 + i, 300) for i in range(32)]
    base = [servers["base"].tokens(p, max_tokens=8) for p in prompts]
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda p: servers["b"].tokens(p, max_tokens=8), prompts))
    assert got == base
    # and once more from a fresh cache: now loaded from the store, still identical. Each
    # prompt's own 300 tokens can only come from the store (the engine's cache was reset;
    # its shared 600 may come from a concurrent request's blocks): without store hits the
    # identical tokens would prove nothing about loading.
    servers["b"].reset_prefix_cache()
    before = hits(servers["b"])
    with ThreadPoolExecutor(32) as pool:
        again = list(pool.map(lambda p: servers["b"].tokens(p, max_tokens=8), prompts))
    assert again == base
    loaded = hits(servers["b"]) - before
    assert loaded >= sum(len(p) - 1 - 600 for p in prompts), loaded


def test_aborts_leave_no_leases_or_pending_writes(servers: dict[str, VllmServer],
                                                  store_x: dict[str, Any]) -> None:
    import httpx

    b = servers["b"]
    p = prompt(7, 1500)
    servers["a"].tokens(p)  # stored, so b's requests below load (lease) before decoding
    with open_store(store_x) as st:
        start = st.stats()
    for _ in range(3):  # client disconnects after the first token: vLLM aborts the request
        b.reset_prefix_cache()
        before = hits(b)
        body = {"model": b.name, "prompt": p, "max_tokens": 500, "stream": True,
                "ignore_eos": True, "temperature": 0.0}
        with httpx.stream("POST", b.url + "/v1/completions", json=body, timeout=120) as r:
            next(r.iter_lines())
        # the request did lease: it loaded its whole prompt from the store (the counter
        # is published with the step's stats, which may trail its first token)
        assert wait_until(lambda b0=before: hits(b) - b0 >= len(p) - 1, 30), hits(b) - before
        assert hits(b) - before == len(p) - 1
    assert b.tokens(p, max_tokens=4) == servers["base"].tokens(p, max_tokens=4)
    with open_store(store_x) as st:
        stats = st.stats()
    assert stats["gets"] > start["gets"]  # objects were leased to b ...
    assert stats["leases"] == 0 and stats["pending"] == 0  # ... and every lease let go,
    assert stats["expired_leases"] == start["expired_leases"]  # released, not timed out


def test_unstartable_store_recomputes_with_identical_tokens(
        servers: dict[str, VllmServer], tiny_model: str, runtime_dir: Path,
        tmp_path: Path) -> None:
    """The store error contract on a real server: the coordinator is killed and cannot be
    restarted (its runtime dir is replaced by a file), so every store call fails; requests
    still complete, by recompute, with the reference tokens and no store hits."""
    import os
    import signal
    import time

    rt = runtime_dir / "gone-rt"
    cfg = {"name": "vllm-gone", "capacity": "64mb", "runtime_dir": str(rt)}
    srv = VllmServer(tiny_model, log_path=tmp_path / "gone.log",
                     kv_transfer=connector_config(cfg))
    try:
        start_all(srv)
        p, q = prompt(300), prompt(301)
        assert srv.tokens(p) == servers["base"].tokens(p)
        with open_store(cfg | {"autostart": False}) as st:
            pid = st.stats()["pid"]
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: not launcher.pid_alive(pid), 10)
        rt.rename(runtime_dir / "gone-rt.moved")
        rt.write_text("not a directory")
        srv.reset_prefix_cache()
        before = hits(srv)
        t0 = time.monotonic()
        assert srv.tokens(p) == servers["base"].tokens(p)  # was a store hit: now recomputed
        assert srv.tokens(q) == servers["base"].tokens(q)
        assert time.monotonic() - t0 < 60
        assert hits(srv) == before
        assert "Traceback" not in (tmp_path / "gone.log").read_text()
        # an engine started while the store cannot be started serves by recompute too
        late = VllmServer(tiny_model, log_path=tmp_path / "late.log",
                          kv_transfer=connector_config(cfg))
        try:
            start_all(late)
            assert late.tokens(q) == servers["base"].tokens(q) and hits(late) == 0
        finally:
            late.stop()
    finally:
        srv.stop()
        if rt.is_file():
            rt.unlink()


def test_tails_load_only_into_the_exact_prompt(servers: dict[str, VllmServer]) -> None:
    """Two prompts share every full block and differ in one tail token: the second never
    loads the first one's tail (a wrong token would follow), only the shared blocks; a
    prompt that ends on a block boundary loads its last block in part."""
    a, b, base = servers["a"], servers["b"], servers["base"]
    p = prompt(400)  # 8 full blocks + a 76-token tail
    q = p[:-2] + [p[-2] + 1, p[-1]]  # same blocks, one tail token differs
    assert a.tokens(p) == base.tokens(p)
    before = hits(b)
    assert b.tokens(q) == base.tokens(q)
    assert hits(b) - before == len(p) // STORED_BLOCK * STORED_BLOCK  # blocks, no tail
    b.reset_prefix_cache()
    before = hits(b)
    assert b.tokens(p) == base.tokens(p)  # the exact prompt: blocks and tail
    assert hits(b) - before == len(p) - 1
    r = prompt(401, 8 * STORED_BLOCK)  # no tail: the last block is loaded but one token
    assert a.tokens(r) == base.tokens(r)
    before = hits(b)
    assert b.tokens(r) == base.tokens(r)
    assert hits(b) - before == len(r) - 1
