"""Hostile KV-event frames: the translator skips what is not a vLLM event, the listener
drops malformed messages and keeps serving, ZMQ cuts a peer sending oversized messages,
and through the router app a valid batch after a storm of garbage still lands."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from kvcentric.hashing import block_hashes, hash_seed
from kvcentric.router.api.app import build_app
from kvcentric.router.fleet import kv_events
from kvcentric.router.fleet.kv_events import EventListener, EventTranslator
from kvcentric.router.tokenize import PromptTokenizer
from kvcentric.testing.servers import free_port
from tests.router.test_router_app import PROFILE, Upstreams, make_cfg

HOSTILE: list[Any] = [None, True, -1, 0, 2**64 - 1, -(2**63), 1.5, float("nan"), "", "abc", b"\x00",
                      [], [1, "x"], [[1, 2]], [None], {"a": 1}, [{}], list(range(300)),
                      [2**40] * 128, ["x"] * 128]
FIELDS = ("type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
          "extra_keys", "lora_name")


def hostile_event(rnd: random.Random) -> Any:
    if rnd.random() < 0.1:
        return rnd.choice(HOSTILE)  # not even a map
    ev: dict[Any, Any] = {"type": rnd.choice(["BlockStored", "BlockRemoved",
                                              "AllBlocksCleared", "Other", 7])}
    for name in FIELDS[1:]:
        if rnd.random() < 0.7:
            ev[name] = rnd.choice(HOSTILE)
    if rnd.random() < 0.2:
        ev[rnd.choice(HOSTILE[2:6])] = rnd.choice(HOSTILE)  # a non-string key
    return ev


def valid(seq: int, tokens: list[int]) -> bytes:
    """One vLLM batch storing ``tokens`` (two 128-token pages) from the root."""
    ev = {"type": "BlockStored", "block_hashes": [seq * 10 + 1, seq * 10 + 2],
          "parent_block_hash": None, "token_ids": tokens, "block_size": 128,
          "extra_keys": None, "lora_name": None}
    return msgspec.msgpack.encode([1.0, [ev], None])


def test_translator_skips_hostile_events_and_keeps_its_state() -> None:
    rnd = random.Random(14)
    tr = EventTranslator("tiny", 256)
    toks = [rnd.randrange(4, 4000) for _ in range(256)]
    want = block_hashes(toks, 256, hash_seed("tiny"))
    assert tr.stored(msgspec.msgpack.decode(valid(0, toks))[1][0]) == want
    for _ in range(5000):
        ev = hostile_event(rnd)
        if not isinstance(ev, dict):
            continue
        assert isinstance(tr.stored(ev), list)
        assert isinstance(tr.removed(ev), list)
    assert tr.skipped > 4000
    more = [rnd.randrange(4, 4000) for _ in range(256)]
    assert tr.stored(msgspec.msgpack.decode(valid(1, more))[1][0]) == \
        block_hashes(more, 256, hash_seed("tiny"))


async def _send_until(pub: zmq.Socket[bytes], frames: list[bytes], done: Any) -> None:
    for _ in range(200):  # a PUB drops messages until its connection is up
        pub.send_multipart(frames)
        await asyncio.sleep(0.02)
        if done():
            return
    raise AssertionError("the listener never processed the message")


def test_listener_drops_garbage_and_cuts_oversized_peers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_events, "MAX_MESSAGE_BYTES", 1 << 16)
    rnd = random.Random(3)
    got: list[list[dict[str, Any]]] = []

    async def run() -> EventListener:
        ctx = zmq.asyncio.Context()
        ep = f"tcp://127.0.0.1:{free_port()}"
        lst = EventListener(ctx, ep, lambda evs: got.append(evs))
        task = asyncio.get_running_loop().create_task(lst.run())
        pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        pub.connect(ep)
        await _send_until(pub, [b"kv", (0).to_bytes(8, "big"), valid(0, [5] * 256)],
                          lambda: lst.batches >= 1)
        enc = msgspec.msgpack.Encoder()
        for i in range(600):
            kind = i % 4
            if kind == 0:
                frames = [rnd.randbytes(rnd.randrange(0, 40)) for _ in range(rnd.randrange(1, 6))]
            elif kind == 1:
                frames = [b"kv", rnd.randbytes(8), rnd.randbytes(rnd.randrange(0, 300))]
            elif kind == 2:
                payload = [rnd.choice(HOSTILE), [hostile_event(rnd) for _ in range(5)], None]
                frames = [b"kv", (i + 1).to_bytes(8, "big"), enc.encode(payload)]
            else:
                frames = [b"kv", (i + 1).to_bytes(8, "big"), enc.encode(rnd.choice(HOSTILE))]
            pub.send_multipart(frames)
        await asyncio.sleep(0.5)
        assert not task.done()
        pub.send_multipart([b"kv", (9).to_bytes(8, "big"), b"\x00" * (1 << 17)])  # oversized
        pub.close(0)
        fresh: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        fresh.connect(ep)
        before = lst.batches
        await _send_until(fresh, [b"kv", (10).to_bytes(8, "big"), valid(1, [6] * 256)],
                          lambda: lst.batches > before)
        fresh.close(0)
        assert not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.term()
        return lst

    lst = asyncio.run(run())
    assert lst.malformed >= 300  # every frame-count/not-msgpack/not-a-batch message


def test_a_connected_listener_makes_the_connection_again_after_an_oversize_message(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's publisher binds and the router connects: ZMQ drops the connection that
    brought an oversize message and, on the connecting side, never makes it again; the
    listener's monitor does, and the same publisher's next batches are applied."""
    monkeypatch.setattr(kv_events, "MAX_MESSAGE_BYTES", 1 << 16)
    got: list[list[dict[str, Any]]] = []

    async def run() -> EventListener:
        ctx = zmq.asyncio.Context()
        ep = f"tcp://127.0.0.1:{free_port()}"
        pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        pub.bind(ep)
        lst = EventListener(ctx, ep, lambda evs: got.append(evs), bind=False)
        task = asyncio.get_running_loop().create_task(lst.run())
        try:
            await _send_until(pub, [b"kv", (0).to_bytes(8, "big"), valid(0, [5] * 256)],
                              lambda: lst.batches >= 1)
            pub.send_multipart([b"kv", (1).to_bytes(8, "big"), b"\x00" * (1 << 17)])
            for _ in range(200):
                if lst.reconnects:
                    break
                await asyncio.sleep(0.02)
            assert lst.reconnects == 1
            before = lst.batches
            await _send_until(pub, [b"kv", (2).to_bytes(8, "big"), valid(1, [6] * 256)],
                              lambda: lst.batches > before)
            assert not task.done()
        finally:
            pub.close(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            ctx.term()
        return lst

    lst = asyncio.run(run())
    assert lst.gaps >= 1  # the oversize message's place: a replay would be asked for


def test_router_app_survives_an_event_storm(tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    ep = f"tcp://127.0.0.1:{free_port()}"
    cfg = make_cfg(tiny_dir, [{"url": "http://a:1", "name": "a", "kv_events": ep}])
    app = build_app(cfg, transport=httpx.MockTransport(Upstreams().handler), tokenizer=tokenizer,
                    profile=PROFILE)
    rnd = random.Random(9)
    enc = msgspec.msgpack.Encoder()

    async def go() -> tuple[int, int]:
        async with app.router.lifespan_context(app):
            app.state.router.conductor.set_block_size(256)
            inst = app.state.router.conductor.registry.get("a")
            inst.translator.reset(256)
            pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
            pub.connect(ep)
            await _send_until(pub, [b"kv", (0).to_bytes(8, "big"), enc.encode([0, [], 0])],
                              lambda: inst.listener.batches >= 1)
            for i in range(300):
                batch = [1.0, [hostile_event(rnd) for _ in range(8)], 0]
                pub.send_multipart([b"kv", (i + 1).to_bytes(8, "big"), enc.encode(batch)])
            toks = [rnd.randrange(4, 4000) for _ in range(256)]
            await _send_until(pub, [b"kv", (400).to_bytes(8, "big"), valid(40, toks)],
                              lambda: len(inst.translator) >= 2)
            pub.close(0)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://router") as c:
                desc = (await c.get("/instances")).json()["instances"][0]
                assert (await c.get("/health")).status_code == 200
            return desc["resident_blocks"], inst.translator.skipped

    resident, skipped = asyncio.run(go())
    assert resident >= 1 and skipped > 100
