"""The table of prefixes on their way into the store (router.fleet.landings)."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.emulator.launch import EmulatedFleet, EmulatorSpec
from benchmarks.serving.gateways import kvcentric_router
from kvcentric.config import StoreConfig
from kvcentric.router.config import RouterConfig
from kvcentric.router.cost.cost_model import Profile
from kvcentric.router.cost.decision import Landing
from kvcentric.router.fleet.landings import Landings
from kvcentric.store import open_store
from kvcentric.store.local import launcher
from kvcentric.testing.models import build_model
from tests.helpers.e2e_store import TEST_HOT_TIMEOUT_S
from tests.helpers.emulated_fleet import FAST
from tests.helpers.waiting import wait_until

H = [bytes([i]) * 16 for i in range(12)]


def test_a_landing_extends_the_stored_run_through_the_blocks_in_flight() -> None:
    t = Landings()
    t.track("first", H[2:8], ready_at=5.0)
    assert t.find(H, 2) == Landing(8, 5.0, ("first",))
    assert t.find(H, 0) is None  # the store's run ends before what is in flight
    assert t.find(H, 8) is None
    assert t.find(H[:5], 2) == Landing(5, 5.0, ("first",))  # a shorter prompt, its part
    # a later prefill of a longer prompt computes only what nobody computes yet
    t.track("second", H[2:11], ready_at=7.0)
    assert t.find(H, 2) == Landing(11, 7.0, ("first", "second"))
    assert t.find(H, 8) == Landing(11, 7.0, ("second",))
    assert t.land("first") == H[2:8]
    assert t.find(H, 2) is None  # stored now: the store's own run answers
    assert t.find(H, 8) == Landing(11, 7.0, ("second",))
    assert t.land("first") == [] and t.land("nobody") == []
    t.track("second", H[0:2], ready_at=1.0)  # one record per request
    assert t.find(H, 0) is None
    assert t.land("second") == H[8:11] and len(t) == 0


def test_a_scanned_prompts_rest_extends_its_landing() -> None:
    """A prompt scan stops at the first block held nowhere: the dispatch knows only the
    start of what the prefill computes; the rest, hashed after it, joins the record."""
    t = Landings()
    t.track("first", [], ready_at=2.0)  # nothing of it known yet
    assert t.find(H, 0) is None
    t.extend("first", H[0:3])
    t.extend("first", H[0:9])  # the whole prompt's: the first three again
    assert t.find(H, 0) == Landing(9, 2.0, ("first",))
    assert t.land("first") == H[0:9]
    t.extend("first", H[0:12])  # landed: nothing more
    assert len(t) == 0


def test_the_table_is_bounded() -> None:
    t = Landings(max_blocks=8)
    t.track("a", H[0:6], ready_at=1.0)
    t.track("b", H[6:12], ready_at=1.0)  # would exceed the bound: not recorded
    assert len(t) == 6 and t.find(H, 6) is None
    t.land("a")
    t.extend("b", H[6:12])  # b is tracked: what it computes fits now
    assert t.find(H, 6) == Landing(12, 1.0, ("b",))
    with pytest.raises(ValueError):
        Landings(max_blocks=0)


def test_waiters_wake_when_the_prefill_lands_or_time_runs_out() -> None:
    asyncio.run(_waiters())


async def _waiters() -> None:
    t = Landings()
    t.track("a", H[0:4], ready_at=1.0)
    t.track("b", H[4:8], ready_at=1.0)
    waiter = asyncio.ensure_future(t.wait(("a", "b"), 30.0))
    await asyncio.sleep(0)
    t.land("a")
    await asyncio.sleep(0)
    assert not waiter.done()  # b is still in flight
    t.land("b")
    assert await asyncio.wait_for(waiter, 5.0) is True
    assert await t.wait(("a", "gone"), 30.0) is True  # nothing left to wait for
    t.track("c", H[0:2], ready_at=1.0)
    assert await t.wait(("c",), 0.01) is False


def test_the_switch_is_a_boolean() -> None:
    base = {"model": "m", "tokenizer": "x"}
    assert RouterConfig.from_dict(base).cost.wait_for_landing is False
    assert RouterConfig.from_dict({**base, "cost": {"wait_for_landing": True}}
                                  ).cost.wait_for_landing is True
    with pytest.raises(ValueError, match="wait_for_landing"):
        RouterConfig.from_dict({**base, "cost": {"wait_for_landing": "maybe"}})


# ---- with a router, emulated engines and a real local store ----

PREFIX, SUFFIX = 2048, 512  # tokens: 16 pages of 128 shared, then each request's own
FOLLOWERS = 6


@pytest.fixture(scope="module")
def stored_fleet(tmp_path_factory: pytest.TempPathFactory, runtime_dir: Path
                 ) -> Iterator[tuple[EmulatedFleet, dict[str, Any], str, Path]]:
    """Three emulated engines whose prefills take about a second (so requests can arrive
    while one runs) sharing a local store; a router cost profile with their timing."""
    logs = tmp_path_factory.mktemp("landing-fleet")
    store = {"name": f"ld{uuid.uuid4().hex[:8]}", "capacity": 256 << 20,
             "runtime_dir": str(runtime_dir), "hot_timeout_s": TEST_HOT_TIMEOUT_S}
    slow = FAST.with_(name="slow", prefill_token_s=4e-4)
    slow.save(logs / "slow.json")
    router_profile = logs / "router-profile.json"
    Profile(a=0.0, b=slow.prefill_token_s, c=slow.api_s + slow.step_s,
            tbt_base_s=slow.step_s, tbt_per_seq_s=slow.decode_seq_s,
            store_bandwidth_bps=slow.store_bandwidth_bps).save(router_profile)
    tok = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    launcher.ensure_running(StoreConfig.from_dict(store))
    try:
        with EmulatedFleet(EmulatorSpec(3, tok, profile=str(logs / "slow.json"), pages=512,
                                        max_model_len=8192, store=store), logs) as f:
            yield f, store, str(router_profile), logs
    finally:
        launcher.stop(StoreConfig.from_dict(store))


def _queued(url: str) -> int:
    r = httpx.get(url + "/instances", timeout=10)
    return sum(i["queued_prefills"] for i in r.json()["instances"])


def followers_of_a_new_prefix(fl: tuple[EmulatedFleet, dict[str, Any], str, Path],
                              landing: bool, text: bool) -> tuple[list[int], str]:
    """A streamed request with a new prefix, then (while its prefill runs)
    :data:`FOLLOWERS` requests sharing the prefix at once: the prompt tokens each follower
    found cached (engine cache or store), and the router's metrics after. ``text``: the
    prompts are text (the router scans them: the first request's dispatch knows only the
    blocks up to its first new one, the rest is hashed after it), else token ids."""
    f, store, profile, logs = fl
    f.reset()
    with open_store(store) as st:
        st.clear()  # type: ignore[attr-defined]
    keys = ("url", "name", "kv_events", "kind", "role")
    g = kvcentric_router(model="bench", tokenizer=str(Path.cwd() / ".models" / "bench"),
                         worker_urls=f.urls, store=store, slo_ttft_ms=60_000,
                         slo_tpot_ms=10_000, logs=logs, reject=False, profile=profile,
                         dtype="bfloat16", tag=f"-landing-{landing}",
                         instances=[{k: s[k] for k in keys if k in s} for s in f.specs],
                         extra={"cost": {"wait_for_landing": landing}})
    rnd = random.Random(7)

    def tokens(n: int) -> list[int] | str:  # text: about 3.3 tokens per word
        if text:
            return "".join(f" w{rnd.randrange(1000, 9999)}" for _ in range(n * 10 // 32))
        return [rnd.randrange(10, 8000) for _ in range(n)]

    prefix = tokens(PREFIX + 128)  # text: at least PREFIX tokens whatever the estimate

    def ask(stream: bool) -> int:
        prompt = prefix + tokens(SUFFIX)  # type: ignore[operator]  # both str or both list
        body: dict[str, Any] = {"model": "bench", "max_tokens": 2, "prompt": prompt}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", g.url + "/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                r.read()
            return -1
        r = httpx.post(g.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    try:
        g.start()
        g.wait_ready(120)
        with ThreadPoolExecutor(FOLLOWERS + 1) as pool:
            first = pool.submit(ask, True)
            assert wait_until(lambda: _queued(g.url) > 0, 30), "the first prefill never queued"
            cached = list(pool.map(ask, [False] * FOLLOWERS))
            first.result()
        metrics = httpx.get(g.url + "/metrics", timeout=10).text
    finally:
        g.stop()
    return cached, metrics


@pytest.mark.parametrize("text", [False, True], ids=["token_ids", "text"])
def test_followers_of_a_prefix_in_flight_load_it_instead_of_computing_it(
        stored_fleet: tuple[EmulatedFleet, dict[str, Any], str, Path], text: bool) -> None:
    """Six requests share a new prefix whose first prefill is running: more than its
    holder should queue. With landings the ones the holder does not take wait for the
    first prefill to store the prefix, then load it on the idle engines: every follower
    finds the whole prefix cached. Without them, some compute it again."""
    cached, metrics = followers_of_a_new_prefix(stored_fleet, landing=True, text=text)
    assert min(cached) >= PREFIX, cached
    assert _counter(metrics, 'kvc_router_held_total{result="landed"}') >= 1
    assert _counter(metrics, 'kvc_router_held_total{result="late"}') == 0
    cached, metrics = followers_of_a_new_prefix(stored_fleet, landing=False, text=text)
    assert min(cached) < PREFIX, cached  # the test can tell: without, a cold copy
    assert _counter(metrics, 'kvc_router_held_total{result="landed"}') == 0


def _counter(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported")
