"""The router serves Mooncake's Conductor indexer API (docs/router.md §Indexer API).

Driven with the request bodies of Mooncake's ``conductor-indexer.md``, over real ZMQ on
loopback: vLLM's own ``ZmqEventPublisher`` (with its replay buffer) as an engine, and a
raw PUB socket speaking RFC #1527 maps as a Mooncake master's pool. The sequence hashes
the tests expect are computed here from the RFC's text alone, never with our code."""

from __future__ import annotations

import asyncio
import gc
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import xxhash

from kvcentric.router.config import RouterConfig
from kvcentric.router.cost.cost_model import Profile
from kvcentric.router.fleet.indexer import TierIndex
from kvcentric.router.fleet.indexer_feeds import Publisher, Registration
from kvcentric.router.tokenize import PromptTokenizer
from kvcentric.seq_hash import seq_hashes
from kvcentric.testing.servers import free_port
from tests.helpers.rfc_publisher import RfcPublisher
from tests.router.test_router_app import Upstreams, run

BS = 16
PROFILE = Profile(a=0.0, b=1e-5, c=0.001)
ADMIN = "sk-admin-indexer"


def rfc_seq_hashes(tokens: list[int], block_size: int, seed: int = 0) -> list[int]:
    """RFC #1527 as written: local = XXH3_64(LE u32 tokens, S); seq_0 = local_0;
    seq_i = XXH3_64(seq_{i-1} LE u64 || local_i LE u64, S)."""
    out: list[int] = []
    for i in range(len(tokens) // block_size):
        part = tokens[i * block_size:(i + 1) * block_size]
        block = b"".join(t.to_bytes(4, "little") for t in part)
        local = xxhash.xxh3_64_intdigest(block, seed=seed)
        out.append(local if not out else xxhash.xxh3_64_intdigest(
            out[-1].to_bytes(8, "little") + local.to_bytes(8, "little"), seed=seed))
    return out


def prompt(seed: int, blocks: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1, 30000) for _ in range(blocks * BS)]


def test_our_sequence_hashes_are_the_rfcs() -> None:
    toks = prompt(1, 5) + [7, 8, 9]  # a partial last block is never hashed
    for seed in (0, 1, 2**64 - 1):
        assert seq_hashes(toks, BS, seed) == rfc_seq_hashes(toks, BS, seed)
    assert len(seq_hashes(toks, BS)) == 5
    # a parent continues the chain exactly where a longer prompt would be
    assert seq_hashes(toks[2 * BS:], BS, parent=seq_hashes(toks, BS)[1]) == seq_hashes(toks, BS)[2:]
    with pytest.raises(ValueError):
        seq_hashes([2**32], 1)


# ---- the app ----
def config(tiny_dir: str, **over: Any) -> RouterConfig:
    raw: dict[str, Any] = {"model": "tiny", "tokenizer": tiny_dir,
                           "health": {"interval_s": 30}, "keys": {"block_size": 256}}
    raw.update(over)
    return RouterConfig.from_dict(raw)


def serve(cfg: RouterConfig, tok: PromptTokenizer,
          fn: Callable[[httpx.AsyncClient], Awaitable[Any]]) -> Any:
    """The router app in process (no upstream call is made: the indexer alone)."""
    return run(cfg, tok, Upstreams(), fn, PROFILE)


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 20.0,
                act: Callable[[], None] | None = None) -> None:
    """Poll ``check`` (doing ``act`` first each round) until it holds; fail at the
    deadline. ``act`` re-publishes what a PUB socket may have sent before the
    subscription reached it."""
    deadline = time.monotonic() + timeout
    while True:
        if act is not None:
            act()
        if await check():
            return
        if time.monotonic() > deadline:
            raise AssertionError("the indexer never got there")
        await asyncio.sleep(0.02)


def register_body(endpoint: str, instance: str, **over: Any) -> dict[str, Any]:
    """Mooncake's documented ``/register`` body, our endpoints."""
    body: dict[str, Any] = {"endpoint": endpoint, "type": "vLLM", "modelname": "deepseek",
                            "lora_name": "", "tenant_id": "default", "instance_id": instance,
                            "block_size": BS, "dp_rank": 0, "additionalsalt": ""}
    body.update(over)
    return body


def query_body(tokens: list[int], **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "deepseek", "lora_name": "", "token_ids": tokens,
                            "tenant_id": "default", "block_size": BS}
    body.update(over)
    return body


class VllmEngine:
    """vLLM's own event publisher (live PUB and replay ROUTER), as an engine runs it."""

    def __init__(self) -> None:
        from vllm.distributed import kv_events as kve  # make setup installs vLLM
        self.kve = kve
        self.live = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        self.pub = kve.ZmqEventPublisher(0, endpoint=self.live.replace("127.0.0.1", "*"),
                                         replay_endpoint=self.replay.replace("127.0.0.1", "*"))
        self.published = 0
        self._next_hash = 1000 * free_port()

    def store(self, tokens: list[int], parent: int | None = None,
              medium: str | None = None) -> list[int]:
        """Publish one BlockStored of ``tokens`` (whole pages); its engine hashes."""
        hs: list[bytes | int] = [self._next_hash + i for i in range(len(tokens) // BS)]
        self._next_hash += len(hs)
        self.batch([self.kve.BlockStored(block_hashes=hs, parent_block_hash=parent,
                                         token_ids=tokens, block_size=BS, lora_id=None,
                                         medium=medium, lora_name=None)])
        return [int(h) for h in hs]

    def remove(self, hashes: list[int]) -> None:
        self.batch([self.kve.BlockRemoved(block_hashes=list[bytes | int](hashes), medium=None)])

    def batch(self, events: list[Any]) -> None:
        self.pub.publish(self.kve.KVEventBatch(ts=time.time(), events=events))
        self.published += 1

    def buffered(self) -> None:
        """Wait until the replay buffer holds everything published (as a late indexer
        finds it: the publisher's thread drains its queue into the buffer)."""
        deadline = time.monotonic() + 10
        while len(self.pub._buffer) < self.published:
            assert time.monotonic() < deadline, "vLLM's publisher never buffered its batches"
            time.sleep(0.01)

    def close(self) -> None:
        self.pub.shutdown()


class PoolPublisher(RfcPublisher):
    """A Mooncake master's RFC #1527 publisher: one batch of one event per ``send``."""

    def send(self, event_type: str, **fields: Any) -> None:  # type: ignore[override]
        super().send([self.event(event_type, **fields)])


def test_the_documented_requests_get_the_documented_answers(
        tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    engine = VllmEngine()
    toks = prompt(2, 4)
    # the engine ran before the indexer knew it: only its replay buffer has these
    first = engine.store(toks[:2 * BS])
    engine.store(toks[2 * BS:], parent=first[-1])
    engine.buffered()
    node = "vllm-prefill-node1"

    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post("/register", json=register_body(engine.live, node,
                                                         replay_endpoint=engine.replay))
        assert r.status_code == 200, r.text
        assert r.json() == {"status": "registered successfully", "instance_id": node}

        async def all_four() -> bool:
            got = (await c.post("/query", json=query_body(toks))).json()
            return bool(got["default"][node]["longest_matched"] == 4 * BS)
        await until(all_four)
        answer = {"default": {node: {"longest_matched": 4 * BS, "GPU": 4 * BS, "CPU": 0,
                                     "DISK": 0, "DP": {"0": 4 * BS}}}}
        assert (await c.post("/query", json=query_body(toks + [1, 2, 3]))).json() == answer
        by_hash = {k: v for k, v in query_body([]).items() if k != "token_ids"}
        r = await c.post("/query_by_hash", json={**by_hash,
                                                 "seq_hashes": rfc_seq_hashes(toks, BS)})
        assert r.json() == answer
        # the earlier drafts' name for the list, and a prompt that leaves after block 1
        other = toks[:BS] + prompt(3, 3)
        r = await c.post("/query_by_hash", json={**by_hash, "instance_id": node,
                                                 "block_hash": rfc_seq_hashes(other, BS)})
        assert r.json()["default"][node]["longest_matched"] == BS

        # the engine evicts the third block: the run ends before it
        engine.remove([first[-1] + 1])

        async def evicted() -> bool:
            got = (await c.post("/query", json=query_body(toks))).json()
            return bool(got["default"][node]["GPU"] == 2 * BS)
        await until(evicted)

        services = (await c.get("/services")).json()["services"]
        assert [(s["instance_id"], s["type"], s["modelname"], s["block_size"])
                for s in services] == [(node, "vLLM", "deepseek", BS)]
        assert services[0]["replayed"] >= 2
        view = (await c.get("/global_view")).json()
        assert view["context_count"] == 1
        assert view["model_contexts"][0]["model_name"] == "deepseek"

        r = await c.post("/unregister", json={"type": "vLLM", "modelname": "deepseek",
                                              "lora_name": "", "tenant_id": "default",
                                              "instance_id": node, "block_size": BS,
                                              "dp_rank": 0})
        assert r.json() == {"status": "unregistered successfully",
                            "removed_instances": [f"{node}|default|0"]}
        again = await c.post("/unregister", json={"instance_id": node, "dp_rank": 0})
        assert again.status_code == 404 and f"{node}|default|0" in again.text
        assert (await c.post("/query", json=query_body(toks))).json() == {"default": {}}
        assert (await c.get("/global_view")).json()["blocks"] == 0

    try:
        serve(config(tiny_dir), tokenizer, fn)
    finally:
        engine.close()


def test_a_store_pools_blocks_count_for_every_instance_on_their_tier(
        tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    a, b, pool = VllmEngine(), VllmEngine(), PoolPublisher()
    toks = prompt(4, 4)
    seqs = rfc_seq_hashes(toks, BS)

    async def fn(c: httpx.AsyncClient) -> None:
        for eng, name in ((a, "a"), (b, "b")):
            r = await c.post("/register", json=register_body(eng.live, name,
                                                             replay_endpoint=eng.replay))
            assert r.status_code == 200, r.text
        r = await c.post("/register", json=register_body(pool.endpoint, "pool-0",
                                                         type="Mooncake"))
        assert r.status_code == 200, r.text

        async def answer() -> dict[str, Any]:
            got: dict[str, Any] = (await c.post("/query", json=query_body(toks))).json()
            return got["default"]

        async def engine_a_holds_two() -> bool:
            return bool((await answer())["a"]["GPU"] == 2 * BS)
        a.store(toks[:2 * BS])
        a.buffered()
        await until(engine_a_holds_two)

        async def pool_holds_three() -> bool:
            return bool((await answer())["b"]["CPU"] == 3 * BS)
        def publish() -> None:  # the first three blocks in the pool's DRAM, the fourth on disk
            pool.send("stored", seq_hashes=seqs[:3], base_block_idx=0, parent_hash=None)
            pool.send("stored", seq_hashes=seqs[3:], base_block_idx=3, parent_hash=seqs[2],
                      medium="disk")
        await until(pool_holds_three, act=publish)
        got = await answer()
        assert got["a"] == {"longest_matched": 4 * BS, "GPU": 2 * BS, "CPU": 3 * BS,
                            "DISK": 0, "DP": {"0": 4 * BS}}
        assert got["b"] == {"longest_matched": 4 * BS, "GPU": 0, "CPU": 3 * BS, "DISK": 0,
                            "DP": {"0": 4 * BS}}
        # the pool is no routing target of its own
        assert set(got) == {"a", "b"}

        pool.send("removed", seq_hashes=seqs[1:2])

        async def pool_lost_the_second() -> bool:
            return bool((await answer())["b"]["CPU"] == BS)
        await until(pool_lost_the_second)
        got = await answer()
        assert got["b"]["longest_matched"] == BS and got["a"]["longest_matched"] == 4 * BS
        pool.send("cleared", medium=None)

        async def pool_cleared() -> bool:
            return bool((await answer())["b"]["longest_matched"] == 0)
        await until(pool_cleared)
        assert (await answer())["a"]["longest_matched"] == 2 * BS

    try:
        serve(config(tiny_dir), tokenizer, fn)
    finally:
        for p in (a, b, pool):
            p.close()


def test_model_adapter_salt_tenant_and_block_size_never_share_blocks(
        tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    pool = PoolPublisher()
    toks = prompt(5, 2)
    seqs = rfc_seq_hashes(toks, BS)

    async def fn(c: httpx.AsyncClient) -> None:
        for name, tenant in (("e", "default"), ("e2", "team-b")):
            # an engine registered in each tenant, and one pool publisher per tenant
            assert (await c.post("/register", json=register_body(
                f"tcp://127.0.0.1:{free_port()}", name, tenant_id=tenant))).status_code == 200
        assert (await c.post("/register", json=register_body(
            pool.endpoint, "pool", type="Mooncake"))).status_code == 200

        async def seen() -> bool:
            got = (await c.post("/query", json=query_body(toks))).json()
            return bool(got["default"]["e"]["CPU"] == 2 * BS)
        await until(seen, act=lambda: pool.send("stored", seq_hashes=seqs, base_block_idx=0))
        for over in ({"model": "other"}, {"lora_name": "sql-adapter"},
                     {"cache_salt": "w8a8"}, {"tenant_id": "team-b"}):
            got = (await c.post("/query", json=query_body(toks, **over))).json()
            tenant = over.get("tenant_id", "default")
            assert all(m["longest_matched"] == 0 for m in got[tenant].values()), over
        # another block size: no instance of that size, and the hashes mean other blocks
        got = (await c.post("/query", json=query_body(toks, block_size=BS // 2))).json()
        assert got == {"default": {}}

    try:
        serve(config(tiny_dir), tokenizer, fn)
    finally:
        pool.close()


def test_bad_requests_are_refused_naming_what_is_wrong(
        tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    ep = f"tcp://127.0.0.1:{free_port()}"

    async def fn(c: httpx.AsyncClient) -> None:
        async def refused(path: str, body: Any, status: int, words: str) -> None:
            r = await c.post(path, json=body, headers={"Authorization": f"Bearer {ADMIN}"})
            assert r.status_code == status, (body, r.text)
            assert words in r.json()["error"]["message"], (words, r.text)

        good = register_body(ep, "e")
        await refused("/register", {k: v for k, v in good.items() if k != "modelname"}, 400,
                      "modelname is required")
        await refused("/register", {**good, "type": "TGI"}, 400, "type must be one of")
        await refused("/register", {**good, "endpoint": "tcp://*:5557"}, 400, "no wildcard")
        await refused("/register", {**good, "block_size": 0}, 400, "block_size must be")
        await refused("/register", {**good, "extra": 1}, 400, "unknown field(s) in a "
                      "registration: extra")
        await refused("/register", [good], 400, "JSON object")
        r = await c.post("/register", json=good, headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200
        await refused("/register", good, 409, "already registered")
        await refused("/query", query_body([2**32]), 400, "token_ids must hold integers")
        await refused("/query", query_body(list(range(5 * BS))), 400,
                      "more than the 64 a query may carry")
        await refused("/query", {**query_body([1]), "lora_id": 3}, 400, "send lora_name")
        no_tokens = {k: v for k, v in query_body([]).items() if k != "token_ids"}
        await refused("/query_by_hash", {**no_tokens, "seq_hashes": [-1]}, 400,
                      "seq_hashes must hold integers")
        # the admin key, as on the router's other operator endpoints
        assert (await c.post("/query", json=query_body([1]))).status_code == 401
        tenant = await c.get("/services", headers={"Authorization": "Bearer sk-tenant-aaaa"})
        assert tenant.status_code == 403

    serve(config(tiny_dir, indexer={"max_query_blocks": 4},
                 auth={"admin_key": ADMIN, "api_keys": {"sk-tenant-aaaa": "t"}}),
          tokenizer, fn)


def test_a_flooding_or_hostile_publisher_is_bounded_and_never_stops_the_listener(
        tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    pool = PoolPublisher()
    toks = prompt(6, 20)
    seqs = rfc_seq_hashes(toks, BS)

    async def fn(c: httpx.AsyncClient) -> None:
        assert (await c.post("/register", json=register_body(
            pool.endpoint, "pool", type="Mooncake"))).status_code == 200

        async def services() -> dict[str, Any]:
            got: dict[str, Any] = (await c.get("/services")).json()["services"][0]
            return got

        async def flooded() -> bool:
            return bool((await services())["stored"] >= len(seqs))

        def hostile_then_flood() -> None:
            pool.sock.send_multipart([b"", b"short", b"x"])  # wrong frames
            pool.sock.send_multipart([b"", (10**6).to_bytes(8, "big"), b"\xc1"])  # no msgpack
            pool.send("stored", seq_hashes=["not", "ints"])
            pool.send("stored", seq_hashes=[-1])
            pool.send("teleported", seq_hashes=seqs[:1])
            pool.send("stored", seq_hashes=seqs, base_block_idx=0)
        await until(flooded, act=hostile_then_flood)
        s = await services()
        assert s["entries"] == 8  # indexer.max_blocks_per_publisher
        assert s["skipped"] >= 3 and s["malformed"] >= 1
        view = (await c.get("/global_view")).json()
        assert view["blocks"] == 8 and view["forgotten"] >= len(seqs) - 8

    try:
        serve(config(tiny_dir, indexer={"max_blocks_per_publisher": 8}), tokenizer, fn)
    finally:
        pool.close()


def test_held_blocks_leave_nothing_for_the_garbage_collector_to_visit() -> None:
    """4,096 blocks stored by an engine's events and 4,096 by a pool's, every one held:
    once the collector has looked, the index and the publishers' page maps keep fewer
    than 512 tracked objects (a scope object, an owner set and their tuples per block kept
    four each, and each full collection visited all of them)."""
    index = TierIndex()
    engine = Publisher(Registration("tcp://127.0.0.1:1", "vLLM", "m", "e0", BS, 0), index,
                       0, 1 << 16)
    pool = Publisher(Registration("tcp://127.0.0.1:2", "Mooncake", "m", "pool", BS, 0),
                     index, 0, 1 << 16)
    index.add_publisher(engine.reg.key, 1 << 16)
    index.add_publisher(pool.reg.key, 1 << 16)
    gc.collect()
    before = len(gc.get_objects())
    rnd = random.Random(7)
    for e in range(64):  # 64 prompts of 64 blocks each
        toks = [rnd.randrange(1000) for _ in range(64 * BS)]
        engine.on_events([{"type": "BlockStored", "block_hashes": [e * 64 + i for i in range(64)],
                           "parent_block_hash": None, "token_ids": toks, "block_size": BS}])
        pool.on_events([{"event_type": "stored", "seq_hashes": [], "token_ids": toks}])
    assert index.blocks() == 4096 and engine.stored == pool.stored == 4096
    gc.collect()
    assert len(gc.get_objects()) - before < 512
    # still answered, per owner: the engine holds its blocks, the pool its copies
    match = index.match(engine.reg.scope(), seq_hashes(toks, BS, 0), {"e0": [0]})
    assert match["e0"].longest == 64 and match["e0"].media == {"gpu": 64, "cpu": 64}
    engine.on_events([{"type": "AllBlocksCleared"}])
    match = index.match(engine.reg.scope(), seq_hashes(toks, BS, 0), {"e0": [0]})
    assert match["e0"].media == {"cpu": 64}


def test_scopes_and_owners_are_forgotten_with_the_last_block_they_hold() -> None:
    """A pool publishing under endless salts and backends, bounded to 8 entries: what the
    index interns stays bounded by what it holds."""
    index = TierIndex()
    pool = Publisher(Registration("tcp://127.0.0.1:2", "Mooncake", "m", "pool", BS, 0),
                     index, 0, 8)
    index.add_publisher(pool.reg.key, 8)
    for i in range(2000):
        pool.on_events([{"event_type": "stored", "seq_hashes": [i], "additional_salt": f"s{i}",
                         "backend_id": f"b{i}"}])
    assert index.entries(pool.reg.key) == 8 and len(index.scopes()) == 8
    assert len(index._scopes.ids) == 8 and len(index._owners.ids) == 8
    pool.on_events([{"event_type": "cleared"}])
    assert index.blocks() == 0 and not index._scopes.ids and not index._owners.ids
