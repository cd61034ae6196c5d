"""The local store's standard KV events (RFC #1527; docs/store.md §KV events).

The coordinator tells subscribers (the router's indexer, Dynamo's or Mooncake's, any
RFC consumer) what it holds: ``stored`` when a block becomes readable in DRAM (``cpu``:
commit, promotion from disk) or on disk (``disk``: demotion, recovery at restart),
``removed`` when it leaves a tier, and one ``cleared`` (``cpu``) when a coordinator
starts, since a new generation's DRAM is empty. Wire: vLLM's three-frame batches
``(topic b"", seq: u64 BE, msgpack [ts, [event, ...], 0])`` on a PUB socket, one batch per
coordinator loop turn that changed anything, the last ``buffer_batches`` kept for replay
on a ROUTER socket (vLLM's protocol: ``(b"", start seq)`` in, every kept batch from there
and an end marker of seq -1 out).

Identity: the store never sees tokens, so it cannot compute the standard XXH3-64 sequence
hashes; ``seq_hashes`` carries the first 8 bytes (big-endian) of kvcentric's own rolling
chain hash, the last part of every block key (docs/architecture.md §The key spec: also a
prefix hash, seeded by model and salt), with ``object_key`` the full key,
``model_name`` the key's model, ``additional_salt`` its ``layout_sig/rank`` (objects of
another layout or TP rank are other blocks), ``parent_hash`` its parent's and
``base_block_idx`` its depth when its whole ancestry is stored. Tails and recurrent-state
objects are not blocks of a prefix and are not published. ``event_id`` counts per stream
(model, salt, medium), as the RFC asks.

Single-threaded (the coordinator's loop). Publishing never blocks: a subscriber too slow
for ZMQ's high-water mark loses batches and finds the gap by sequence number.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

import msgspec

from kvcentric.store.local.config import EventsConfig

if TYPE_CHECKING:
    from kvcentric.store.local.index import Entry

CPU, DISK = "cpu", "disk"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STORED, _REMOVED, _CLEARED = 0, 1, 2
_HEX = frozenset("0123456789abcdef")


def block_identity(key: str) -> tuple[str, str, int] | None:
    """``(model, salt, seq hash)`` of a block key ``kvc/v2/{model_id}/{layout_sig}/
    {rank}of{size}/{32 hex}`` (the model id may hold slashes), None for anything else (a
    tail, a recurrent state, a foreign key)."""
    parts = key.rsplit("/", 3)
    if len(parts) != 4 or not parts[0].startswith("kvc/v"):
        return None
    head, sig, rank, last = parts
    model = head.split("/", 2)[2] if head.count("/") >= 2 else ""
    if len(last) != 32 or not model or "of" not in rank or not _HEX.issuperset(last):
        return None
    return model, f"{sig}/{rank}", int(last[:16], 16)


class StoreEvents:
    """One coordinator's publisher: binds its sockets at construction (``zmq.ZMQError``
    when an address is taken), then :meth:`stored`/:meth:`removed` queue events and
    :meth:`flush` publishes them as one batch."""

    def __init__(self, cfg: EventsConfig, backend_id: str) -> None:
        import zmq

        self._zmq = zmq
        self.backend_id = backend_id
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: Any = None
        try:
            self._pub.bind(cfg.endpoint)
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, 1 << 10)  # a request is 3 frames
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError:
            self.close()
            raise
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_batches)
        self._seq = 0
        # what happened this loop turn, as cheap tuples: the events are built at flush,
        # after the turn's replies went out (so a put never waits for them)
        self._pending: list[tuple[Any, ...]] = [(_CLEARED, CPU)]  # a new generation's DRAM
        self._ids: dict[tuple[str | None, str | None, str], int] = {}
        self.published = 0  # events
        self.replays = 0
        self._encoder = msgspec.msgpack.Encoder()

    @property
    def replay_fd(self) -> int | None:
        """The replay socket's file descriptor, to wake the coordinator's select."""
        return None if self._replay is None else int(self._replay.getsockopt(
            self._zmq.FD))

    # ---- events ----
    def stored(self, e: Entry, medium: str) -> None:
        """``e`` became readable on ``medium``."""
        self._pending.append((_STORED, medium, e.key, e.parent,
                              e.depth if e.complete else None))

    def removed(self, key: str, medium: str) -> None:
        """The object ``key`` left ``medium``."""
        self._pending.append((_REMOVED, medium, key))

    def _build(self, now_ms: int) -> list[dict[str, Any]]:
        """The queued changes as RFC events (blocks only), ``event_id`` per stream."""
        out = []
        ids = self._ids
        for item in self._pending:
            kind, medium = item[0], item[1]
            if kind == _CLEARED:
                model = salt = None
                body: dict[str, Any] = {}
                name = "cleared"
            else:
                ident = block_identity(item[2])
                if ident is None:
                    continue
                model, salt, h = ident
                if kind == _STORED:
                    parent = block_identity(item[3]) if item[3] else None
                    body = {"seq_hashes": [h], "base_block_idx": item[4],
                            "parent_hash": parent[2] if parent else None, "token_ids": None,
                            "object_key": item[2]}
                    name = "stored"
                else:
                    body = {"seq_hashes": [h], "object_key": item[2]}
                    name = "removed"
            stream = (model, salt, medium)
            ids[stream] = event_id = ids.get(stream, 0) + 1
            out.append({"event_id": event_id, "timestamp": now_ms, "event_type": name,
                        "model_name": model, "block_size": None, "additional_salt": salt,
                        "lora_name": None, "tenant_id": "default",
                        "backend_id": self.backend_id, "medium": medium, "dp_rank": 0,
                        **body})
        return out

    # ---- wire ----
    def flush(self) -> None:
        """Publish what was queued since the last flush as one batch (never blocks)."""
        if not self._pending:
            return
        now = time.time()
        events = self._build(int(now * 1000))
        self._pending = []
        if not events:
            return
        payload = self._encoder.encode([now, events, 0])
        self.published += len(events)
        seq = self._seq
        self._seq += 1
        self._ring.append((seq, payload))
        try:
            self._pub.send_multipart([b"", seq.to_bytes(8, "big"), payload],
                                     flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            pass  # no subscriber keeps up: it sees the gap and replays

    def serve_replays(self) -> None:
        """Answer every replay request waiting (without blocking)."""
        sock, zmq = self._replay, self._zmq
        if sock is None:
            return
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue  # not a replay request: dropped
            who, start = frames[0], int.from_bytes(frames[2], "big")
            self.replays += 1
            try:
                for seq, payload in list(self._ring):
                    if seq >= start:
                        sock.send_multipart([who, b"", b"", seq.to_bytes(8, "big"), payload],
                                            flags=zmq.NOBLOCK)
                sock.send_multipart([who, b"", b"", END_SEQ, b""], flags=zmq.NOBLOCK)
            except zmq.Again:
                continue  # that requester stopped reading: it will ask again

    def close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
