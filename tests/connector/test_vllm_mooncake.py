"""Our vLLM connector on the mooncake backend, end to end: two real vLLM CPU servers share
KV through a real Mooncake Store (master + storage node) in a private network namespace.

The engines are pure Mooncake clients (segment 0); the memory is a storage node's. Faults:
the master killed (requests recompute, no hang) and restarted (hits resume), the storage
node killed (no wrong tokens), a store too small for the KV (puts fail, requests succeed).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcentric.store import open_store
from kvcentric.testing.models import build_model
from kvcentric.testing.netns import NetNamespace, unavailable_reason
from kvcentric.testing.servers import VllmServer, connector_config
from tests.helpers.mooncake_cluster import MooncakeCluster, cluster

pytest.importorskip("mooncake.store", reason="the Mooncake wheel is not installed")
_NO_NETNS = unavailable_reason()
pytestmark = [pytest.mark.vllm, pytest.mark.mooncake,
              pytest.mark.skipif(_NO_NETNS is not None, reason=f"no netns: {_NO_NETNS}")]
BLOCK = 128  # stored block = one CPU page of the tiny model
REQUEST_BOUND_S = 60.0  # a request during an outage may recompute, never hang


def prompt(seed: int, n: int = 1100) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(4, 4000) for _ in range(n)]


def hits(server: VllmServer) -> float:
    return server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)


@pytest.fixture(scope="module")
def mc(tmp_path_factory: pytest.TempPathFactory, mooncake_ns: NetNamespace
       ) -> Iterator[MooncakeCluster]:
    with cluster(tmp_path_factory.mktemp("mooncake-vllm"), ns=mooncake_ns) as c:
        c.start_node("pool", "256mb")
        yield c


@pytest.fixture(autouse=True)
def _in_netns(mc: MooncakeCluster) -> Iterator[None]:
    with mc.entered():
        yield


@pytest.fixture(scope="module")
def servers(mc: MooncakeCluster, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, VllmServer]]:
    model = str(build_model("tiny", Path.cwd() / ".models" / "tiny"))
    logs = tmp_path_factory.mktemp("vllm-mooncake-logs")
    store = mc.store_config()
    made = {name: VllmServer(model, log_path=logs / f"{name}.log",
                             kv_transfer=connector_config(store)) for name in ("a", "b")}
    with mc.entered():  # the servers' processes (and their Mooncake clients) live inside
        try:
            for s in made.values():
                s.start()
            for s in made.values():
                s.wait_ready()
            yield made
        finally:
            for s in made.values():
                s.stop()


def timed_tokens(server: VllmServer, p: list[int]) -> list[int]:
    t0 = time.monotonic()
    out = server.tokens(p)
    assert time.monotonic() - t0 < REQUEST_BOUND_S
    return out


def test_second_instance_loads_the_first_ones_prefix(servers: dict[str, VllmServer]) -> None:
    a, b = servers["a"], servers["b"]
    p = prompt(1)
    want = a.tokens(p)
    before = hits(b)
    assert b.tokens(p) == want
    m = b.metrics()
    # every full block and the tail: all but the last token are loaded
    assert m["vllm:external_prefix_cache_hits_total"] - before == len(p) - 1
    assert m["vllm:kvcentric_loaded_blocks_total"] >= len(p) // BLOCK + 1


def test_master_killed_requests_recompute_then_hits_resume(
        servers: dict[str, VllmServer], mc: MooncakeCluster) -> None:
    a, b = servers["a"], servers["b"]
    mc.kill_master()
    p = prompt(2)
    want = timed_tokens(a, p)
    before = hits(b)
    assert timed_tokens(b, p) == want and hits(b) == before  # nothing stored, all computed
    mc.start_master()  # empty; the node remounts, the engines' clients reconnect
    deadline, seed = time.monotonic() + 90, 100
    while True:
        p = prompt(seed)
        want, before = a.tokens(p), hits(b)
        assert b.tokens(p) == want
        if hits(b) > before:
            break
        assert time.monotonic() < deadline, "hits never resumed after the master came back"
        seed += 1
        time.sleep(1.0)


def test_storage_node_killed_no_wrong_tokens(servers: dict[str, VllmServer],
                                             mc: MooncakeCluster) -> None:
    a, b = servers["a"], servers["b"]
    p = prompt(3)
    want = a.tokens(p)  # stored on the node
    errors = b.metrics().get("vllm:kvcentric_load_errors_total", 0.0)
    mc.kill_node("pool")
    # the master still lists the node's objects (until its client TTL): loads fail, recompute
    assert timed_tokens(b, p) == want
    assert b.metrics()["vllm:kvcentric_load_errors_total"] > errors  # the failure was seen
    assert timed_tokens(b, prompt(4)) == timed_tokens(a, prompt(4))
    mc.start_node("pool", "256mb")


def test_full_store_requests_still_succeed(servers: dict[str, VllmServer],
                                          mc: MooncakeCluster) -> None:
    """A 16 MiB pool (Mooncake's smallest) and prompts of ~15.5 MiB of KV each: saves are
    refused or evict each other; every request still answers the same tokens."""
    a, b = servers["a"], servers["b"]
    mc.kill_node("pool")
    mc.start_node("pool", "16mb")
    saved_before = a.metrics().get("vllm:kvcentric_saved_blocks_total", 0.0)
    with open_store(mc.store_config()) as probe:  # stats come from the master's HTTP
        deadline = time.monotonic() + 90  # the killed node's segment counts until its TTL
        while probe.stats()["capacity_bytes"] != 16 << 20:
            assert time.monotonic() < deadline, probe.stats()
            time.sleep(1.0)
        evicted_before = probe.stats()["evictions"]
        prompts = [prompt(seed, 4000) for seed in (5, 6, 7)]
        for p in prompts:
            assert timed_tokens(b, p) == timed_tokens(a, p)
        st = probe.stats()
    saved = a.metrics().get("vllm:kvcentric_saved_blocks_total", 0.0) - saved_before
    full_blocks = sum((len(p) - 1) // BLOCK for p in prompts)
    assert st["used_bytes"] <= st["capacity_bytes"] == 16 << 20
    assert saved < full_blocks or st["evictions"] > evicted_before, (saved, st)
    mc.kill_node("pool")
    mc.start_node("pool", "256mb")
