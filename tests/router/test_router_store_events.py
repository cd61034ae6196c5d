"""The router routes by the store's own KV events (docs/router.md §Store residency):
an emulated Mooncake master publishes RFC #1527 events naming objects by their keys
(``object_key``; its ``seq_hashes`` are empty for keys that are no integers, as the master
sends them), and the router's decisions count exactly the blocks those events say the
store holds, with no store configured to ask."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable

import httpx

from kvcentric.hashing import KeySpace, block_hashes, hash_seed
from kvcentric.router.api.app import build_app
from kvcentric.router.config import RouterConfig
from kvcentric.router.cost.cost_model import Profile
from kvcentric.router.fleet.store_events import StoreFeed
from kvcentric.router.tokenize import PromptTokenizer
from tests.helpers.rfc_publisher import RfcPublisher

BS = 16
SIG = "00112233445566ff"
KS = KeySpace("tiny", SIG, 0, 1)
PROFILE = Profile(a=0.0, b=1e-5, c=0.001, tbt_base_s=0.01, tbt_per_seq_s=0.0)


def prompt(seed: int, blocks: int = 4) -> tuple[list[int], list[str]]:
    rnd = random.Random(seed)
    toks = [rnd.randrange(10, 200) for _ in range(blocks * BS + 3)]
    return toks, [KS.key(h) for h in block_hashes(toks, BS, hash_seed("tiny"))]


class MasterPublisher(RfcPublisher):
    """What ``mooncake_master --enable_kv_events`` sends: one event per object, by key (its
    ``seq_hashes`` empty for keys that are no integers, legacy aliases beside them)."""

    def send(self, kind: str, keys: list[str],  # type: ignore[override]
             medium: str = "cpu") -> None:
        super().send([self.event(kind, medium=medium, seq_hashes=[], object_key=k,
                                 type="BlockStored" if kind == "stored" else "BlockRemoved",
                                 block_hashes=[]) for k in keys])


async def engines(request: httpx.Request) -> httpx.Response:
    if request.url.path in ("/health", "/metrics"):
        return httpx.Response(200, text="")
    body = json.loads(request.content)
    return httpx.Response(200, json={"id": "c", "object": "text_completion",
                                     "model": body["model"], "choices": [
                                         {"index": 0, "text": " x", "finish_reason": "length"}]})


def serve(tiny_dir: str, tok: PromptTokenizer, master: MasterPublisher,
          fn: Callable[[httpx.AsyncClient, StoreFeed], Awaitable[None]]) -> None:
    cfg = RouterConfig.from_dict({
        "model": "tiny", "tokenizer": tiny_dir, "health": {"interval_s": 30},
        "slo": {"ttft_ms": 60000, "tbt_ms": 1000},
        "keys": {"block_size": BS, "layout_sig": SIG},
        "store_events": {"endpoint": master.endpoint},
        "instances": [{"url": "http://a:1", "name": "a"}, {"url": "http://b:1", "name": "b"}]})
    app = build_app(cfg, transport=httpx.MockTransport(engines), tokenizer=tok,
                    profile=PROFILE)

    async def go() -> None:
        async with app.router.lifespan_context(app):
            feed = app.state.router.conductor.store.feed
            assert feed is not None and app.state.router.conductor.store.enabled
            # PUB/SUB: publish a foreign key until the subscription shows it arrived
            deadline = time.monotonic() + 20
            while feed.foreign == 0:
                assert time.monotonic() < deadline, "the router never subscribed"
                master.send("stored", ["kvc/v2/other-model/x/0of1/" + "0" * 32])
                await asyncio.sleep(0.02)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://router") as client:
                await fn(client, feed)

    asyncio.run(go())


async def applied(feed: StoreFeed, n: int) -> None:
    deadline = time.monotonic() + 10
    while feed.applied < n:
        assert time.monotonic() < deadline, f"{feed.applied} of {n} events applied"
        await asyncio.sleep(0.01)


async def hit_tokens(c: httpx.AsyncClient, toks: list[int]) -> int:
    r = await c.post("/v1/completions", json={"model": "tiny", "prompt": toks,
                                              "max_tokens": 1})
    assert r.status_code == 200, r.text
    return int(r.headers["x-kvc-hit-tokens"])


def test_decisions_count_what_the_masters_events_say_the_store_holds(
        tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    master = MasterPublisher()

    async def fn(c: httpx.AsyncClient, feed: StoreFeed) -> None:
        a_toks, a_keys = prompt(1)
        assert await hit_tokens(c, a_toks) == 0  # nothing stored: no store call either
        b_toks, b_keys = prompt(2)
        master.send("stored", b_keys[:3])
        await applied(feed, 3)
        assert await hit_tokens(c, b_toks) == 3 * BS
        # the master evicts the third block of another prompt: the run ends before it
        d_toks, d_keys = prompt(3)
        master.send("stored", d_keys)
        master.send("removed", d_keys[2:3])
        await applied(feed, 3 + 4 + 1)
        assert await hit_tokens(c, d_toks) == 2 * BS
        # another layout's, rank's and model's keys are not this model's blocks
        e_toks, e_keys = prompt(4)
        other = [k.replace(SIG, "ffffffffffffffff") for k in e_keys]
        other += [k.replace("/0of1/", "/1of2/") for k in e_keys]
        before = feed.foreign
        master.send("stored", other)
        master.send("stored", e_keys[:1])
        await applied(feed, 3 + 4 + 1 + 1)
        assert feed.foreign == before + len(other)
        assert await hit_tokens(c, e_toks) == BS

    try:
        serve(tiny_dir, tokenizer, master, fn)
    finally:
        master.close()


def test_the_feed_keeps_tiers_and_is_bounded() -> None:
    feed = StoreFeed("tiny", None, max_keys=4)
    _, keys = prompt(5, blocks=3)
    hashes = block_hashes(prompt(5, blocks=3)[0], BS, hash_seed("tiny"))
    ev = [{"event_type": "stored", "medium": "cpu", "object_key": k} for k in keys]
    ev += [{"event_type": "stored", "medium": "disk", "object_key": keys[1]},
           {"event_type": "removed", "medium": "cpu", "object_key": keys[1]},
           {"event_type": "teleported", "medium": "cpu", "object_key": keys[0]},
           {"event_type": "stored", "medium": 7, "object_key": keys[0]}]
    feed.on_events(ev)
    assert feed.keyspace == KS  # the layout learnt from the first key of this model
    assert feed.residency(hashes) == (3, (1,))  # the second block is on disk only
    assert feed.skipped == 2
    feed.on_events([{"event_type": "cleared", "medium": "disk"}])
    assert feed.residency(hashes) == (1, ())
    more = [KS.key(bytes([i]) * 16) for i in range(6)]
    feed.on_events([{"event_type": "stored", "medium": "cpu", "object_key": k} for k in more])
    assert len(feed) == 4 and feed.forgotten >= 4
    assert feed.residency(hashes) == (0, ())  # the oldest were forgotten first
