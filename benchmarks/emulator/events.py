"""vLLM's (or SGLang's) KV cache events, as an emulated engine publishes them: same
structs, same wire.

The structs mirror ``vllm.distributed.kv_events`` (0.32) field for field: msgspec
structs tagged by class name (``{"type": "BlockStored", ...}``), defaults omitted, the
batch an array ``[ts, events, data_parallel_rank]``; encoded with msgspec's msgpack they
are byte-identical to vLLM's (``tests/test_emulator_wire.py`` compares them).

:class:`Publisher` is vLLM's ``ZmqEventPublisher`` on asyncio: a PUB socket sending
``(topic, seq: u64 big-endian, payload)`` per step, and, with a replay endpoint, a ROUTER
socket answering ``[client, b"", start_seq: u64 BE]`` with every buffered batch from
``start_seq`` on as ``(client, b"", topic, seq, payload)`` and then the end marker
``(client, b"", b"", -1 as i64 BE, b"")``. It keeps the last ``buffer_steps`` batches.
Endpoints bind as vLLM binds them (``tcp://*:PORT`` or ``ipc://``: bound; the emulator
binds a ``*`` host on 127.0.0.1 only); a plain ``tcp://host:port`` is connected to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger("emulator.events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True,  # type: ignore[call-arg]
                 gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False,  # type: ignore[call-arg]
                   tag=True):
    """Base of the events (tagged ``"type": <class name>``)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# SGLang's (``sglang.srt.disaggregation.kv_events``), field for field: the same tags and
# frames; its batch keeps ``attn_dp_rank`` even at its default, its ``BlockStored`` has
# the request's ``cache_salt`` instead of vLLM's extra keys and group fields.
class SglangEventBatch(msgspec.Struct, array_like=True,  # type: ignore[call-arg]
                       gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class SglangBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SglangBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SglangKVEventBatch(SglangEventBatch):
    events: list[SglangBlockStored | SglangBlockRemoved | AllBlocksCleared]


def stored(hashes: list[int], parent: int | None, tokens: list[int], page: int,
           salt: str | None) -> BlockStored:
    """A ``BlockStored`` as vLLM's block pool builds it for newly cached pages (group 0,
    no LoRA; the cache salt is the first page's extra key)."""
    extra: list[tuple[Any, ...] | None] = [None] * len(hashes)
    if salt is not None and parent is None:
        extra[0] = (salt,)
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=tokens,
                       block_size=page, lora_id=None, medium=MEDIUM_GPU, lora_name=None,
                       extra_keys=extra, group_idx=0)


def removed(h: int) -> BlockRemoved:
    """A ``BlockRemoved`` for one evicted page, as vLLM emits them (one per page)."""
    return BlockRemoved(block_hashes=[h], medium=MEDIUM_GPU, group_idx=0)


def sglang_stored(h: int, parent: int | None, tokens: list[int],
                  salt: str | None) -> SglangBlockStored:
    """A ``BlockStored`` as SGLang's radix cache records one page (``record_store``: one
    event per page, hashes as signed int64, the request's ``cache_salt`` on each)."""
    return SglangBlockStored(block_hashes=[_i64(h)],
                             parent_block_hash=None if parent is None else _i64(parent),
                             token_ids=tokens, block_size=len(tokens), lora_id=None,
                             medium=MEDIUM_GPU, cache_salt=salt)


def sglang_removed(h: int) -> SglangBlockRemoved:
    """SGLang's ``BlockRemoved`` of one evicted page."""
    return SglangBlockRemoved(block_hashes=[_i64(h)], medium=MEDIUM_GPU)


def _i64(h: int) -> int:
    """An emulated page hash (unsigned) as SGLang's signed int64 hashes."""
    h &= 2**64 - 1
    return h - 2**64 if h >= 2**63 else h


_encoder = msgspec.msgpack.Encoder()


def encode_batch(events: list[Any], ts: float | None = None, dp_rank: int = 0,
                 kind: str = "vllm") -> bytes:
    """One step's events as the payload vLLM (or, ``kind`` ``sglang``, SGLang)
    publishes."""
    t = time.time() if ts is None else ts
    if kind == "sglang":
        return _encoder.encode(SglangKVEventBatch(ts=t, events=events, attn_dp_rank=dp_rank))
    return _encoder.encode(KVEventBatch(ts=t, events=events, data_parallel_rank=dp_rank))


def _bind_address(endpoint: str) -> str:
    """Where the emulator binds a vLLM-style bound endpoint (``*`` -> 127.0.0.1)."""
    return endpoint.replace("*", "127.0.0.1")


def binds(endpoint: str) -> bool:
    """vLLM binds wildcard and ipc/inproc endpoints and connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class Publisher:
    """One engine's event publisher (see the module docstring). Call :meth:`start` on the
    event loop, :meth:`publish` once per step with that step's events, :meth:`close`."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, replay: str | None = None,
                 buffer_steps: int = 10_000, topic: str = "", kind: str = "vllm") -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay
        self.kind = kind  # whose wire format: vllm or sglang
        self.topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(100_000)
        self._router: zmq.asyncio.Socket | None = None
        try:
            if binds(endpoint):
                self._pub.bind(_bind_address(endpoint))
            else:
                self._pub.connect(endpoint)
            if replay is not None:
                self._router = ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(_bind_address(replay))
        except zmq.ZMQError:
            self.close()
            raise
        self._task: asyncio.Task[None] | None = None
        self.replays = 0

    @property
    def seq(self) -> int:
        """The sequence number the next batch gets."""
        return self._seq

    def start(self) -> None:
        if self._router is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replays())

    def publish(self, events: list[Any]) -> None:
        """Send one batch (nothing when ``events`` is empty, as vLLM skips empty steps)."""
        if not events:
            return
        payload = encode_batch(events, kind=self.kind)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload),
                                     flags=zmq.NOBLOCK)

    async def _serve_replays(self) -> None:
        assert self._router is not None
        try:
            while True:
                frames = await self._router.recv_multipart()
                if len(frames) != 3:
                    log.warning("invalid replay request of %d frames", len(frames))
                    continue
                client, _, start = frames
                first = int.from_bytes(start, "big")
                self.replays += 1
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        await self._router.send_multipart(
                            (client, b"", self.topic, seq.to_bytes(8, "big"), payload))
                await self._router.send_multipart((client, b"", b"", END_SEQ, b""))
        except (asyncio.CancelledError, zmq.ZMQError):
            pass

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
