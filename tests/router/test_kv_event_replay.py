"""A router that (re)starts, or loses event batches, rebuilds an engine's residency from
the engine's replay buffer: vLLM's own ``ZmqEventPublisher`` as the engine (publishing
before the router listens), and a raw engine-like peer for the gap and hostile cases."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvcentric.hashing import block_hashes, hash_seed
from kvcentric.router.fleet.kv_events import EventListener, EventTranslator
from kvcentric.testing.servers import free_port
from tests.helpers.waiting import wait_until

PAGE = 128
BLOCK = 256


def tokens(seed: int, n: int = BLOCK * 2) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(4, 4000) for _ in range(n)]


class Residency:
    """What the router's index would hold for one instance: our blocks, from events."""

    def __init__(self) -> None:
        self.tr = EventTranslator("tiny", BLOCK)
        self.blocks: set[bytes] = set()
        self.order: list[int] = []  # the first vLLM hash of each stored batch, in order

    def __call__(self, events: list[dict[str, Any]]) -> None:
        for ev in events:
            if ev.get("type") == "BlockStored":
                self.order.append(ev["block_hashes"][0])
                self.blocks.update(self.tr.stored(ev))
            elif ev.get("type") == "BlockRemoved":
                self.blocks.difference_update(self.tr.removed(ev))


def ours(toks: list[int]) -> set[bytes]:
    return set(block_hashes(toks, BLOCK, hash_seed("tiny")))


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def _vllm_batches() -> tuple[list[Any], list[list[int]]]:
    from vllm.distributed import kv_events as kve  # make setup installs vLLM: never a skip
    seqs = [tokens(s) for s in range(3)]

    def stored(i: int, toks: list[int]) -> Any:
        hs: list[bytes | int] = [i * 100 + k for k in range(len(toks) // PAGE)]
        return kve.BlockStored(block_hashes=hs, parent_block_hash=None, token_ids=toks,
                               block_size=PAGE, lora_id=None, medium=None, lora_name=None)

    batches = [kve.KVEventBatch(ts=1.0, events=[stored(i, t)]) for i, t in enumerate(seqs)]
    # the engine evicts the second prompt's last page: its second block is gone
    batches.append(kve.KVEventBatch(ts=2.0, events=[kve.BlockRemoved(block_hashes=[103],
                                                                     medium=None)]))
    return batches, seqs


@pytest.mark.parametrize("replay", [True, False])
def test_a_late_router_rebuilds_residency_from_the_engines_replay(replay: bool) -> None:
    from vllm.distributed import kv_events as kve  # make setup installs vLLM: never a skip
    batches, seqs = _vllm_batches()
    live_ep, replay_ep = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    # the engine runs (and publishes) before the router exists: those batches are lost
    # to a plain subscriber, and only the replay buffer still has them
    pub = kve.ZmqEventPublisher(0, endpoint=live_ep, replay_endpoint=replay_ep)
    try:
        for b in batches:
            pub.publish(b)
        # the publisher's thread serves a replay request before it drains its queue into
        # the replay buffer: ask only once the engine has buffered what it published, as a
        # late router would find it
        assert wait_until(lambda: len(pub._buffer) >= len(batches), 10)

        async def run() -> tuple[Residency, EventListener]:
            ctx = zmq.asyncio.Context()
            seen = Residency()
            lst = EventListener(ctx, live_ep, seen, replay=replay_ep if replay else None)
            task = asyncio.get_running_loop().create_task(lst.run())
            try:
                if replay:
                    await until(lambda: lst.batches >= 4)
                    assert lst.replayed == 4
                    assert seen.blocks == ours(seqs[0]) | ours(seqs[1][:BLOCK]) | ours(seqs[2])
                # without replay nothing published before the listener can arrive; the
                # evidence that it would have by now is the live batch below, received
                later = tokens(9)
                live = kve.KVEventBatch(ts=3.0, events=[kve.BlockStored(
                    block_hashes=[900, 901, 902, 903], parent_block_hash=None,
                    token_ids=later, block_size=PAGE, lora_id=None, medium=None,
                    lora_name=None)])
                for _ in range(100):  # the engine's PUB reconnects to the router's bind
                    pub.publish(live)
                    await asyncio.sleep(0.05)
                    if ours(later) <= seen.blocks:
                        break
                assert ours(later) <= seen.blocks
                if not replay:  # it receives, and got none of the earlier batches
                    assert seen.blocks == ours(later) and lst.replayed == 0
                assert lst.replay_failures == 0 and not task.done()
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                ctx.term()
            return seen, lst

        seen, lst = asyncio.run(run())
        if replay:  # every replayed batch applied once, in order
            assert seen.order[:3] == [0, 100, 200]
    finally:
        pub.shutdown()


def _batch(seq: int) -> list[bytes]:
    ev = {"type": "BlockStored", "block_hashes": [seq * 10 + k for k in range(4)],
          "parent_block_hash": None, "token_ids": tokens(seq), "block_size": PAGE,
          "extra_keys": None, "lora_name": None}
    return [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [ev], None])]


class Engine:
    """An engine-like peer: a PUB that skips some batches and a ROUTER replaying its
    buffer (``answer``: how it answers a replay request)."""

    def __init__(self, answer: str = "ok") -> None:
        self.ctx = zmq.asyncio.Context()
        self.live = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(self.live)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(self.replay)
        self.answer = answer
        self.buffer: list[list[bytes]] = []
        self.requests: list[int] = []

    async def serve(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            self.requests.append(int.from_bytes(start, "big"))
            if self.answer == "silent":
                continue
            if self.answer == "garbage":
                await self.router.send_multipart([ident, b"", b"x"])
                continue
            for frames in self.buffer:
                if int.from_bytes(frames[1], "big") >= self.requests[-1]:
                    await self.router.send_multipart([ident, b"", *frames])
            await self.router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big",
                                                                           signed=True), b""])

    def publish(self, seq: int, live: bool = True) -> None:
        frames = _batch(seq)
        self.buffer.append(frames)
        if live:
            self.pub.send_multipart(frames)

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


@contextlib.asynccontextmanager
async def listening(eng: Engine, seen: Residency, **kw: Any) -> AsyncIterator[EventListener]:
    """``eng`` serving replays and a listener on it, both stopped on exit."""
    server = asyncio.get_running_loop().create_task(eng.serve())
    lctx = zmq.asyncio.Context()
    lst = EventListener(lctx, eng.live, seen, bind=False, replay=eng.replay, **kw)
    task = asyncio.get_running_loop().create_task(lst.run())
    try:
        yield lst
        assert not task.done()
    finally:
        task.cancel()
        server.cancel()
        await asyncio.gather(task, server, return_exceptions=True)
        lctx.term()
        eng.close()


def test_a_gap_in_the_live_stream_is_filled_from_the_replay() -> None:
    async def run() -> None:
        eng, seen = Engine(), Residency()
        async with listening(eng, seen) as lst:
            await until(lambda: eng.requests == [0])  # the start-up replay (empty buffer)
            for _ in range(200):  # a SUB misses what is sent before its connection is up
                eng.publish(0)
                await asyncio.sleep(0.02)
                if lst.batches:
                    break
            eng.buffer = eng.buffer[-1:]
            eng.publish(1)
            eng.publish(2, live=False)  # lost on the way
            eng.publish(3, live=False)
            eng.publish(4)
            await until(lambda: lst.batches >= 5)
            assert eng.requests == [0, 2]
            assert [h // 10 for h in seen.order][-4:] == [1, 2, 3, 4]  # in order, once each
            assert lst.duplicates == 1
            assert seen.blocks == set().union(*(ours(tokens(s)) for s in range(5)))

    asyncio.run(run())


@pytest.mark.parametrize("answer", ["silent", "garbage"])
def test_a_replay_that_fails_is_abandoned_and_live_events_still_land(answer: str) -> None:
    async def run() -> None:
        eng, seen = Engine(answer), Residency()
        async with listening(eng, seen, replay_timeout_s=0.5) as lst:
            await until(lambda: lst.replay_failures == 1)
            for _ in range(200):
                eng.publish(0)
                await asyncio.sleep(0.02)
                if lst.batches:
                    break
            assert ours(tokens(0)) <= seen.blocks

    asyncio.run(run())


def test_no_replay_before_the_listener_is_ready() -> None:
    """Until the router knows the block size, a replay would only be skipped: it waits."""
    async def run() -> None:
        eng, seen, ready = Engine(), Residency(), [False]
        eng.publish(0, live=False)
        async with listening(eng, seen, ready=lambda: ready[0]) as lst:
            await asyncio.sleep(0.3)
            assert eng.requests == [] and lst.batches == 0
            ready[0] = True
            await until(lambda: lst.replayed == 1)
            assert ours(tokens(0)) <= seen.blocks

    asyncio.run(run())
