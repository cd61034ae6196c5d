"""Several router replicas in front of one (emulated) fleet, each fed by the engines' KV
events: they agree on where a prefix lives; one killed and started again routes by
prefix again soon after it is up (the engines' event replay), and only requests in
flight to it fail. Also the bounds that keep a long-running router's memory flat: the
event translator's page map and the prefix index."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.emulator.launch import EmulatedFleet
from benchmarks.serving.gateways import Gateway
from kvcentric.hashing import block_hashes, hash_seed
from kvcentric.router.fleet.engine_metrics import EngineStats
from kvcentric.router.fleet.instance_spec import InstanceSpec
from kvcentric.router.fleet.instances import Instance
from kvcentric.router.fleet.kv_events import EventTranslator
from kvcentric.router.fleet.prefix_index import PrefixIndex
from tests.helpers.emulated_fleet import fleet as emulated_fleet
from tests.helpers.emulated_fleet import router as fleet_router
from tests.helpers.waiting import wait_until

# ------------------------------------------------------------------------------ bounds

def test_the_translators_page_map_is_bounded() -> None:
    tr = EventTranslator("bench", 16, max_pages=50)
    rnd = random.Random(0)
    for i in range(400):  # pages whose removals the router never saw
        toks = [rnd.randrange(10, 8000) for _ in range(16)]
        tr.stored({"type": "BlockStored", "block_hashes": [i], "parent_block_hash": None,
                   "token_ids": toks, "block_size": 16})
    assert len(tr) == 50 and tr.forgotten == 350
    # what it kept still translates: a child of the newest page
    child = tr.stored({"type": "BlockStored", "block_hashes": [1000], "parent_block_hash": 399,
                       "token_ids": list(range(16)), "block_size": 16})
    assert len(child) == 1


def test_the_index_holds_at_most_each_instances_capacity() -> None:
    index = PrefixIndex()
    index.add_slot(0, 100)
    rnd = random.Random(1)
    for _ in range(500):
        index.add(0, [rnd.randbytes(16) for _ in range(8)])
    assert index.resident(0) == 100 and len(index._owners) == 100


# ------------------------------------------------------------------- replicas, restart

@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmulatedFleet, Path]]:
    logs = tmp_path_factory.mktemp("replicas")
    with emulated_fleet(logs, 4) as f:
        yield f, logs


def router(f: EmulatedFleet, logs: Path, tag: str) -> Gateway:
    return fleet_router(f, logs, tag, replay=True,
                        extra={"health": {"metrics_interval_s": 1.0}})


def prompt(seed: int, n: int = 1024) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(10, 8000) for _ in range(n)]


def complete(url: str, toks: list[int]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60,
                      json={"model": "bench", "prompt": toks, "max_tokens": 2})


def test_a_restarted_replica_routes_by_prefix_within_2_s_and_only_in_flight_fail(
        fleet: tuple[EmulatedFleet, Path]) -> None:
    f, logs = fleet
    a, b = router(f, logs, "-a"), router(f, logs, "-b")
    try:
        for g in (a, b):
            g.start()
        for g in (a, b):
            g.wait_ready(120)
        hot = prompt(7)
        first = complete(a.url, hot + prompt(100, 64))
        assert first.status_code == 200
        owner = first.headers["x-kvc-prefill"]
        # the other replica learnt it from the engine's events, not from the request
        deadline = time.monotonic() + 10
        while True:
            r = complete(b.url, hot + prompt(101, 64))
            if int(r.headers["x-kvc-hit-tokens"]) >= 1024 - 128:
                break
            assert time.monotonic() < deadline, "replica b never learnt the prefix"
            time.sleep(0.1)
        assert r.headers["x-kvc-prefill"] == owner

        # load through both replicas; b killed and started again meanwhile
        stop = threading.Event()
        results: list[tuple[str, float, float, int | None]] = []

        async def load() -> None:
            async with httpx.AsyncClient(timeout=60) as c:
                k = 0
                while not stop.is_set():
                    url = (a.url, b.url)[k % 2]
                    t0 = time.monotonic()
                    status = None
                    for u in (url, a.url if url == b.url else b.url):  # LB failover
                        try:
                            resp = await c.post(u + "/v1/completions", json={
                                "model": "bench", "prompt": hot + prompt(1000 + k, 64),
                                "max_tokens": 8})
                            status = resp.status_code
                            break
                        except httpx.ConnectError:
                            continue
                        except httpx.HTTPError:
                            status = None
                            break
                    results.append((url, t0, time.monotonic(), status))
                    k += 1
                    await asyncio.sleep(0.02)

        th = threading.Thread(target=lambda: asyncio.run(load()))
        th.start()
        # the load flows through both replicas before the kill
        assert wait_until(lambda: {x[0] for x in results if x[3] == 200} == {a.url, b.url},
                          60), results[-3:]
        assert b.proc is not None
        t_kill = time.monotonic()
        os.killpg(os.getpgid(b.proc.pid), signal.SIGKILL)
        b.proc.wait()
        t_dead = time.monotonic()  # requests sent before this may have reached it
        # the load has met the dead replica (and failed over) before it comes back
        assert wait_until(lambda: any(x[0] == b.url and x[1] > t_dead for x in results), 60)
        b.start()
        b.wait_ready(120)
        t_ready = time.monotonic()
        t_prefix = None
        while time.monotonic() - t_ready < 10:
            r = complete(b.url, hot + prompt(int(1e6 * random.random()), 64))
            if int(r.headers["x-kvc-hit-tokens"]) >= 1024 - 128:
                t_prefix = time.monotonic()
                break
            time.sleep(0.05)
        # and keeps flowing through the restarted replica for a few more requests
        assert t_prefix is not None
        assert wait_until(lambda: sum(x[0] == b.url and x[1] > t_prefix and x[3] == 200
                                      for x in results) >= 5, 60), results[-3:]
        stop.set()
        th.join(60)
        assert t_prefix is not None and t_prefix - t_ready <= 2.0, t_prefix
        failed = [x for x in results if x[3] != 200]
        in_flight = [x for x in results if x[0] == b.url and x[1] <= t_dead and x[2] >= t_kill]
        assert len(failed) <= len(in_flight), (failed, in_flight)
        assert len(results) > 20
    finally:
        a.stop()
        b.stop()


def test_replicas_see_the_same_residency(fleet: tuple[EmulatedFleet, Path]) -> None:
    f, logs = fleet
    gws = [router(f, logs, f"-r{i}") for i in range(2)]
    try:
        for g in gws:
            g.start()
        for g in gws:
            g.wait_ready(120)
        for i in range(6):
            assert complete(gws[i % 2].url, prompt(200 + i, 512)).status_code == 200

        def views() -> list[dict[str, int]]:
            return [{i["name"]: i["resident_blocks"] for i in
                     httpx.get(g.url + "/instances", timeout=10).json()["instances"]}
                    for g in gws]

        want = set(block_hashes(prompt(200, 512), 128, hash_seed("bench")))
        assert len(want) == 4
        # the KV events reach both replicas: wait until each holds every prompt's blocks
        # (6 prompts of 4 blocks: positive evidence that all events arrived) and their
        # views agree
        seen: list[list[dict[str, int]]] = []
        assert wait_until(lambda: seen.append(views()) or (
            seen[-1][0] == seen[-1][1] and sum(seen[-1][0].values()) >= 6 * len(want)),
            30, interval=0.2), seen[-1:]
    finally:
        for g in gws:
            g.stop()


def test_work_other_replicas_queued_counts_until_the_engine_has_worked_it_off() -> None:
    """An engine's ``waiting`` beyond this router's own requests is another replica's
    work: costed at this router's mean prefill here, and worked off at one second per
    second until the next ``/metrics`` read."""
    inst = Instance(InstanceSpec(url="http://127.0.0.1:1", name="a"), slot=0)
    inst.enqueue("r1", 0.5, 100.0)
    inst.enqueue("r2", 0.5, 100.0)
    own = inst.queue_s(100.0)
    assert own == pytest.approx(1.0)
    inst.read_stats(EngineStats(running=1, waiting=1), 100.0)  # only its own: no foreign
    assert inst.queue_s(100.0) == pytest.approx(own)
    inst.read_stats(EngineStats(running=1, waiting=5), 100.0)  # 4 more than its own
    assert inst.queue_s(100.0) == pytest.approx(own + 4 * 0.5)
    assert inst.foreign_left(101.5) == pytest.approx(0.5)
    assert inst.foreign_left(103.0) == 0.0
    inst.metrics_at = float("-inf")  # a restarted engine: nothing known of its queue
    assert inst.foreign_left(100.0) == 0.0
