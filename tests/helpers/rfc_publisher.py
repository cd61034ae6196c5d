"""A KV event publisher speaking RFC #1527 on vLLM's wire, as a Mooncake master does
(``enable_kv_events``): a PUB socket bound on loopback, three-frame batches ``(b"", seq
u64 BE, msgpack [ts, [event, ...], 0])``, each event the standard envelope plus what
the caller adds. Tests use it as the store pool whose events a router consumes."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

from kvcentric.testing.servers import free_port


class RfcPublisher:
    """``send`` one batch of events (``event_id`` counted here); close when done."""

    def __init__(self, backend_id: str = "pool-node-0") -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.backend_id = backend_id
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)
        self.seq = self.event_id = 0

    def event(self, event_type: str, **fields: Any) -> dict[str, Any]:
        """One event: the RFC envelope (``cpu``, tenant ``default``) with ``fields`` over it."""
        self.event_id += 1
        return {"event_id": self.event_id, "timestamp": int(time.time() * 1000),
                "event_type": event_type, "model_name": None, "block_size": None,
                "additional_salt": None, "lora_name": None, "tenant_id": "default",
                "backend_id": self.backend_id, "medium": "cpu", "dp_rank": 0, **fields}

    def send(self, events: list[dict[str, Any]]) -> None:
        payload = msgspec.msgpack.encode([time.time(), events, 0])
        self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
