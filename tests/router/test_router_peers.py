"""Router replicas that sync (router.fleet.peers) book each other's dispatches as their own,
over real ZMQ sockets on loopback; a hostile or broken peer's frames are dropped one by
one, never crash the receiver or move its state."""

from __future__ import annotations

import asyncio
import math

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvcentric.hashing import block_hashes, hash_seed
from kvcentric.router.conductor import Conductor
from kvcentric.router.config import PeersConfig, RouterConfig
from kvcentric.router.cost.cost_model import Profile
from kvcentric.router.fleet.instance_spec import InstanceSpec
from kvcentric.router.fleet.peers import (
    DISPATCHED,
    DONE,
    RESIDENT,
    VERSION,
    PeerMessage,
    PeerSync,
)
from kvcentric.router.fleet.store_view import StoreView
from kvcentric.testing.servers import free_port

BS = 16


def conductor(tiny_dir: str) -> Conductor:
    cfg = RouterConfig.from_dict({"model": "tiny", "tokenizer": tiny_dir,
                                  "keys": {"block_size": BS}})
    c = Conductor(cfg, Profile(a=0.0, b=1e-3, c=0.01), 1024, StoreView(None, "tiny"))
    for n in ("e0", "e1"):
        c.registry.add(InstanceSpec(url=f"http://{n}:1", role="both", name=n))
    return c


def hashes(seed: int, blocks: int = 8) -> list[bytes]:
    return block_hashes([seed * 1000 + i for i in range(blocks * BS)], BS, hash_seed("tiny"))


async def settle(cond: object, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():  # type: ignore[operator]
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("peer state did not arrive")
        await asyncio.sleep(0.01)


def test_a_replicas_dispatch_queues_and_places_its_prefix_on_the_other(tiny_dir: str) -> None:
    async def run() -> None:
        ctx = zmq.asyncio.Context()
        pa, pb = free_port(), free_port()
        a, b = conductor(tiny_dir), conductor(tiny_dir)
        sa = PeerSync(ctx, a, f"tcp://127.0.0.1:{pa}", [f"tcp://127.0.0.1:{pb}"])
        sb = PeerSync(ctx, b, f"tcp://127.0.0.1:{pb}", [f"tcp://127.0.0.1:{pa}"])
        a.peers, b.peers = sa, sb
        tasks = [asyncio.create_task(s.run()) for s in (sa, sb)]
        # PUB/SUB drops what is sent before a subscription reaches its publisher: each
        # side announces the end of a dispatch nobody booked (harmless) until the other
        # has counted one
        for src, dst in ((sa, sb), (sb, sa)):
            deadline = asyncio.get_running_loop().time() + 10
            while dst.received == 0:
                assert asyncio.get_running_loop().time() < deadline, "never subscribed"
                src.announce_done("probe")
                await asyncio.sleep(0.01)
        probes = sb.received
        try:
            h = hashes(1)
            d = a.decide_local(h, len(h) * BS, 0)
            assert not isinstance(d, type(None))
            e = b.registry.get(d.prefill.name)
            assert e is not None and e.queue_s(b.clock()) == 0.0
            a.dispatched(d, "r1", h[:3])  # a prompt scan that stopped after 3 blocks
            await settle(lambda: e.queue_s(b.clock()) > 0.0)
            # b now sees a's queued prefill and the prompt's blocks on that instance
            assert b.index.match(h, 0b11)[e.slot] == 3
            other = b.decide_local(hashes(2), 8 * BS, 0)
            assert other.prefill.name != e.name  # a new prompt avoids the queued instance
            # then the rest of the prompt, hashed after the dispatch
            a.resident_beyond_scan(d, "r1", h)
            await settle(lambda: b.index.match(h, 0b11)[e.slot] == len(h))
            # a prompt longer than one message carries: its leading blocks arrive, the
            # connection stays
            long = [i.to_bytes(16, "big") for i in range(80_000)]
            a.resident_beyond_scan(d, "r1", long)
            await settle(lambda: b.index.match(long[:64], 0b11)[e.slot] == 64)
            assert 0 < b.index.match(long, 0b11)[e.slot] < len(long)
            assert sb.reconnects == 0
            a.prefill_finished(d, "r1", None)
            await settle(lambda: e.queue_s(b.clock()) == 0.0)
            # the dispatch, the rests and its end (probes in flight may add to the count;
            # the queue also drains by itself once the prediction is long past)
            await settle(lambda: sb.received >= probes + 4)
            assert sb.dropped == 0
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            sa.close()
            sb.close()
            ctx.term()

    asyncio.run(run())


def test_hostile_frames_are_dropped_and_the_receiver_keeps_going(tiny_dir: str) -> None:
    enc = msgspec.msgpack.Encoder()
    good_h = hashes(3)
    frames = [
        b"", b"\xff" * 64, b"\x91" * 100_000,  # garbage, an unfinished deep nest
        b"\x91" * 100_000 + b"\xc0",  # 100k arrays nested in one another, then nil
        enc.encode([VERSION, DISPATCHED]),  # missing fields
        enc.encode([VERSION, DISPATCHED, "s", "r", "e0", 0.1, good_h, "extra"]),
        enc.encode([VERSION + 1, DISPATCHED, "s", "r", "e0", 0.1, good_h]),
        enc.encode([VERSION, 7, "s", "r", "e0", 0.1, good_h]),
        enc.encode([VERSION, DISPATCHED, "s", "r", "e0", math.nan, good_h]),
        enc.encode([VERSION, DISPATCHED, "s", "r", "e0", 1e9, good_h]),
        enc.encode([VERSION, DISPATCHED, "s", "r", "e0", 0.1, [b"short"]]),
        enc.encode([VERSION, DISPATCHED, "s" * 10_000, "r", "e0", 0.1, good_h]),
        enc.encode([VERSION, DISPATCHED, "s", "r", "e0", "fast", good_h]),
        enc.encode([VERSION, RESIDENT, "s", "r", "", 0.0, good_h]),  # on no instance
        enc.encode([VERSION, RESIDENT, "s", "r", "e0", 0.0, [b"short"]]),
    ]
    oversize = b"x" * (2 << 20)  # over the size bound: ZMQ drops the connection

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        port = free_port()
        c = conductor(tiny_dir)
        sync = PeerSync(ctx, c, None, [f"tcp://127.0.0.1:{port}"])
        c.peers = sync
        task = asyncio.create_task(sync.run())
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"tcp://127.0.0.1:{port}")

        async def subscribed() -> None:
            """PUB/SUB drops what is sent before the subscription reaches the publisher:
            send a harmless valid message (the end of a dispatch nobody booked) until
            the receiver counts one, the evidence that the connection carries frames."""
            n = sync.received
            deadline = asyncio.get_running_loop().time() + 10
            while sync.received == n:
                assert asyncio.get_running_loop().time() < deadline, "never subscribed"
                await pub.send(enc.encode(PeerMessage(VERSION, DONE, "probe", "none")))
                await asyncio.sleep(0.01)

        await subscribed()
        try:
            for f in frames:
                await pub.send(f)
            await settle(lambda: sync.dropped == len(frames))
            await pub.send(oversize)  # (a dropped connection loses the frames it had queued)
            await settle(lambda: sync.reconnects >= 1)
            await subscribed()
            # a message for an instance this router does not know: booked nowhere (checked
            # once the message sent after it on the same connection has been booked)
            await pub.send(enc.encode(PeerMessage(VERSION, DISPATCHED, "s", "x", "nope",
                                                  0.5, good_h)))
            await pub.send(enc.encode(PeerMessage(VERSION, RESIDENT, "s", "x", "nope",
                                                  hashes=good_h)))
            # the receiver still books what a real peer sends
            await pub.send(enc.encode(PeerMessage(VERSION, DISPATCHED, "s", "r", "e1",
                                                  0.5, good_h)))
            e1 = c.registry.get("e1")
            assert e1 is not None
            await settle(lambda: e1.queue_s(c.clock()) > 0.0)
            assert not task.done()
            assert all(i.queue_s(c.clock()) == 0.0 for i in c.registry if i is not e1)
            assert {s for s, n in c.index.match(good_h, 0b11).items() if n} == {e1.slot}
            await pub.send(enc.encode(PeerMessage(VERSION, DONE, "s", "r")))
            await settle(lambda: e1.queue_s(c.clock()) == 0.0)
            assert sync.dropped == len(frames)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close(0)
            sync.close()
            ctx.term()

    asyncio.run(run())


def test_a_dispatch_whose_end_never_arrives_leaves_with_its_predicted_work(
        tiny_dir: str) -> None:
    c = conductor(tiny_dir)
    c.peer_dispatched("peer:s:r", "e0", 0.2, hashes(4))
    e0 = c.registry.get("e0")
    assert e0 is not None
    now = c.clock()
    assert e0.queue_s(now) == pytest.approx(0.2, abs=0.05)
    assert e0.queue_s(now + 0.25) == 0.0  # its replica died: the work drains anyway


@pytest.mark.parametrize("raw, msg", [
    ({"publish": "tcp://0.0.0.0:5000"}, "not a loopback"),
    ({"publish": "udp://127.0.0.1:5000"}, "must be tcp"),
    ({"connect": ["tcp://127.0.0.1"]}, "must be tcp"),
])
def test_peer_config_refuses_what_it_cannot_use_safely(raw: dict[str, object],
                                                        msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        PeersConfig(**raw)  # type: ignore[arg-type]
    assert PeersConfig(publish="tcp://0.0.0.0:5000", allow_remote=True).enabled
