"""Router replicas telling each other what they dispatched.

Replicas learn residency from the engines' KV events, but not each other's work in
flight: a prefill another replica sent is invisible until the engine's ``/metrics``
shows it waiting (a poll away) and its prefix until the engine announces the blocks
(after the prefill). Each replica then sees a fraction of a hot instance's queue and
sends it more, or computes a prefix already being computed elsewhere. With ``peers``
configured every replica publishes, on a ZMQ PUB socket, each dispatch (request id,
prefill instance, predicted prefill seconds, the prompt's block hashes) and each
prefill's end, and the rest of a prompt whose scan stopped short once it is hashed after
the dispatch (:mod:`kvcentric.router.prompt_scan`); every other replica subscribes and
books them as its own (queued work on the instance's processor, the blocks as resident
there), so all replicas decide on the same state within a message's latency. A dispatch
whose end never arrives (its replica died) leaves when its predicted work is done, as an
own prefill does (:mod:`kvcentric.router.cost.processor`).

Wire format: msgpack arrays decoded against :class:`PeerMessage` (unknown fields,
wrong types, oversize hashes or names, non-finite times: the message is dropped and
counted, the connection kept). The channel carries no secrets (block hashes are salted
per tenant) but a peer can mislead load estimates: bind it to loopback or a network
only the replicas reach (the same NetworkPolicy as the engines' KV events).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

if TYPE_CHECKING:
    from kvcentric.router.conductor import Conductor
    from kvcentric.router.cost.decision import Decision

log = logging.getLogger("router.fleet.peers")

VERSION = 1
# a replica that does not know a kind drops its messages (counted): RESIDENT came later
DISPATCHED, DONE, RESIDENT = 0, 1, 2
MAX_MESSAGE_BYTES = 1 << 20
MAX_NAME = 128
MAX_PREFILL_S = 3600.0


class PeerMessage(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    version: int
    kind: int  # DISPATCHED, DONE or RESIDENT
    sender: str  # the publishing replica's id
    rid: str
    prefill: str = ""  # the prefill instance's name (DISPATCHED, RESIDENT)
    prefill_s: float = 0.0  # predicted seconds of work queued there: load + compute (DISPATCHED)
    hashes: list[bytes] = []  # the prompt's block hashes (DISPATCHED; RESIDENT: all of them)


def valid(m: PeerMessage, hash_bytes: int) -> bool:
    """Whether a decoded message is one a replica could have sent."""
    if m.version != VERSION or m.kind not in (DISPATCHED, DONE, RESIDENT):
        return False
    if not (0 < len(m.sender) <= MAX_NAME and 0 < len(m.rid) <= MAX_NAME
            and len(m.prefill) <= MAX_NAME):
        return False
    if m.kind == DONE:
        return True
    if m.kind == RESIDENT and not m.prefill:
        return False
    return (math.isfinite(m.prefill_s) and 0.0 <= m.prefill_s <= MAX_PREFILL_S
            and all(len(h) == hash_bytes for h in m.hashes))


class PeerSync:
    """This replica's publisher and its subscription to the other replicas.

    ``publish``: the endpoint this replica binds (``tcp://127.0.0.1:PORT``); ``connect``:
    the other replicas' endpoints. :meth:`run` receives until cancelled; the ``announce_*``
    methods never block (a slow or absent subscriber drops messages: ZMQ PUB)."""

    def __init__(self, ctx: zmq.asyncio.Context, conductor: Conductor,
                 publish: str | None, connect: Sequence[str], hash_bytes: int = 16) -> None:
        self.conductor = conductor
        self.connect = tuple(connect)
        self.id = secrets.token_hex(8)
        self.hash_bytes = hash_bytes
        self.received = 0
        self.dropped = 0
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(PeerMessage)
        self.reconnects = 0
        self._pub: zmq.asyncio.Socket | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        if publish:
            self._pub = ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, 10000)
            self._pub.bind(publish)
        if connect:
            self._sub = ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            # ZMQ drops a connection that sent an oversize frame and never reconnects it
            self._monitor = self._sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            for ep in connect:
                self._sub.connect(ep)

    # ---- what this replica did ----
    def announce_dispatch(self, d: Decision, rid: str, hashes: Sequence[bytes]) -> None:
        self._send(PeerMessage(VERSION, DISPATCHED, self.id, rid, d.prefill.name,
                               d.work_s, self._fit(hashes)))

    def announce_resident(self, d: Decision, rid: str, hashes: Sequence[bytes]) -> None:
        """The whole prompt's ``hashes`` of request ``rid``, dispatched as ``d`` on the
        start of its prompt (:meth:`Conductor.resident_beyond_scan
        <kvcentric.router.conductor.Conductor.resident_beyond_scan>`)."""
        self._send(PeerMessage(VERSION, RESIDENT, self.id, rid, d.prefill.name,
                               hashes=self._fit(hashes)))

    def _fit(self, hashes: Sequence[bytes]) -> list[bytes]:
        """The leading ``hashes`` that fit one message: a longer one would make every
        subscriber's ZMQ drop the connection, and a prompt's leading blocks are still where
        its prefix is."""
        return list(hashes[:(MAX_MESSAGE_BYTES - 4096) // (self.hash_bytes + 2)])

    def announce_done(self, rid: str) -> None:
        self._send(PeerMessage(VERSION, DONE, self.id, rid))

    def _send(self, m: PeerMessage) -> None:
        if self._pub is None:
            return
        try:
            self._pub.send(self._enc.encode(m), zmq.NOBLOCK)
        except zmq.ZMQError:  # full queue: the peers' estimates fall back to /metrics
            pass

    # ---- what the others did ----
    async def run(self) -> None:
        """Receive and book the peers' messages until cancelled; a connection ZMQ dropped
        (an oversize frame, a peer restarting) is made again."""
        if self._sub is None or self._monitor is None:
            return
        sub, mon = self._sub, self._monitor
        recv = asyncio.ensure_future(sub.recv())
        event = asyncio.ensure_future(mon.recv_multipart())
        try:
            while True:
                await asyncio.wait((recv, event), return_when=asyncio.FIRST_COMPLETED)
                if recv.done():
                    self.handle(recv.result())
                    recv = asyncio.ensure_future(sub.recv())
                if event.done():
                    ev = parse_monitor_message(event.result())
                    ep = ev.get("endpoint")
                    if isinstance(ep, bytes) and ep.decode() in self.connect:
                        sub.disconnect(ep.decode())
                        sub.connect(ep.decode())
                        self.reconnects += 1
                    event = asyncio.ensure_future(mon.recv_multipart())
        finally:
            recv.cancel()
            event.cancel()

    def handle(self, raw: bytes) -> None:
        """Book one peer message (dropped, counted, if it does not decode or check)."""
        try:
            m = self._dec.decode(raw)
        except (msgspec.DecodeError, ValueError):
            self.dropped += 1
            return
        if not valid(m, self.hash_bytes) or m.sender == self.id:
            self.dropped += 1
            return
        self.received += 1
        key = f"peer:{m.sender}:{m.rid}"
        if m.kind == DISPATCHED:
            self.conductor.peer_dispatched(key, m.prefill, m.prefill_s, m.hashes)
        elif m.kind == RESIDENT:
            self.conductor.peer_resident(m.prefill, m.hashes)
        else:
            self.conductor.peer_done(key)

    def close(self) -> None:
        if self._sub is not None:
            self._sub.disable_monitor()
        for s in (self._monitor, self._pub, self._sub):
            if s is not None:
                s.close(0)
