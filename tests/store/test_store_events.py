"""The local store publishes RFC #1527 KV events (docs/store.md §KV events), and a
consumer written from the RFC alone (below: it imports nothing of ours) rebuilds the
store's contents from them: live, from the replay buffer, and after a missed range.

Real coordinators over real ZMQ sockets on loopback; every wait polls the consumer's
state against the store's own answer, with a deadline."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvcentric.config import StoreConfig
from kvcentric.store import OK, open_store
from kvcentric.store.local import launcher
from kvcentric.store.local.config import DiskConfig, EventsConfig
from kvcentric.testing.servers import free_port
from tests.store.store_contract import put

SIG = "0123456789abcdef"
END = (-1).to_bytes(8, "big", signed=True)


def key(model: str, n: int, rank: str = "0of1") -> str:
    """A block key of our spec: kvc/v2/{model}/{layout_sig}/{rank}/{32 hex}."""
    return f"kvc/v2/{model}/{SIG}/{rank}/{random.Random(n).getrandbits(128):032x}"


def chain(model: str, start: int, n: int) -> tuple[list[str], list[str | None]]:
    keys = [key(model, start + i) for i in range(n)]
    return keys, [None, *keys[:-1]]


@dataclass
class RfcConsumer:
    """What the RFC asks of a consumer, and nothing of kvcentric: SUB to the publisher's
    three-frame batches ``(topic, seq u64 BE, msgpack [ts, events, dp_rank])``; events
    ``stored``/``removed``/``cleared`` keyed by ``seq_hashes`` per medium; a gap in the
    batch sequence asks the replay endpoint (vLLM's protocol) from the first missing one."""

    endpoint: str
    replay_endpoint: str
    ctx: zmq.Context = field(default_factory=zmq.Context)
    held: dict[str, dict[int, str]] = field(default_factory=dict)  # medium -> hash -> key
    last_seq: int = -1
    replays: int = 0
    skip: set[int] = field(default_factory=set)  # batch seqs to lose on purpose

    def __post_init__(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.endpoint)

    def apply(self, payload: bytes) -> None:
        _ts, events, _dp = msgspec.msgpack.decode(payload)
        for ev in events:
            medium = ev["medium"]
            tier = self.held.setdefault(medium, {})
            if ev["event_type"] == "stored":
                for h in ev["seq_hashes"]:
                    tier[h] = ev.get("object_key", "")
            elif ev["event_type"] == "removed":
                for h in ev["seq_hashes"]:
                    tier.pop(h, None)
            elif ev["event_type"] == "cleared":
                tier.clear()

    def replay(self, start: int) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        try:
            while True:
                assert sock.poll(10_000), "the store never finished a replay"
                _, _topic, seq, payload = sock.recv_multipart()
                if seq == END:
                    break
                n = int.from_bytes(seq, "big")
                if n > self.last_seq:
                    self.apply(payload)
                    self.last_seq = n
        finally:
            sock.close(0)
        self.replays += 1

    def pump(self) -> None:
        """Take every live batch waiting; replay what a gap lost."""
        while self.sub.poll(0):
            _topic, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if seq in self.skip:
                self.skip.discard(seq)
                continue
            if seq <= self.last_seq:
                continue
            if seq > self.last_seq + 1:
                self.replay(self.last_seq + 1)
            if seq > self.last_seq:
                self.apply(payload)
                self.last_seq = seq

    def keys(self, medium: str) -> set[str]:
        return set(self.held.get(medium, {}).values())

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


def events_cfg() -> EventsConfig:
    return EventsConfig(endpoint=f"tcp://127.0.0.1:{free_port()}",
                        replay_endpoint=f"tcp://127.0.0.1:{free_port()}")


def until(check: Any, consumer: RfcConsumer, act: Any = None, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if act is not None:
            act()
        consumer.pump()
        if check():
            return
        assert time.monotonic() < deadline, "the consumer never caught up with the store"
        time.sleep(0.02)  # a poll interval inside a deadline loop, not a synchronisation


def test_an_rfc_consumer_rebuilds_the_store_live_from_replay_and_after_a_missed_range(
        store_cfg: StoreConfig) -> None:
    cfg = store_cfg.with_(events=events_cfg())
    store = open_store(cfg)
    consumer = RfcConsumer(cfg.local.events.endpoint, cfg.local.events.replay_endpoint)  # type: ignore[union-attr]
    try:
        a, pa = chain("tiny", 0, 5)
        b, pb = chain("org/model-7b", 100, 3)  # a model id with a slash
        assert put(store, a, pa) == [OK] * 5 and put(store, b, pb) == [OK] * 3
        tail = a[0].rsplit("/", 1)[0] + "/t17-" + "ab" * 16
        assert put(store, [tail], [a[-1]]) == [OK]
        assert store.remove(a[4]) == OK
        want = set(a[:4]) | set(b)
        # a consumer that starts late rebuilds everything from the replay buffer
        consumer.replay(0)
        assert consumer.keys("cpu") == want  # tails are no blocks: not published

        # live: new blocks arrive as they commit (the first batch may beat the
        # subscription; any later one shows the gap and replays it)
        c, pc = chain("tiny", 200, 4)
        todo = iter(range(4))

        def put_next() -> None:
            i = next(todo, None)
            if i is not None:
                assert put(store, [c[i]], [pc[i]]) == [OK]
        until(lambda: consumer.keys("cpu") == want | set(c), consumer, put_next)
        want |= set(c)

        # a missed range: the next two live batches are lost; the one after replays them
        consumer.skip = {consumer.last_seq + 1, consumer.last_seq + 2}
        d, pd = chain("tiny", 300, 3)
        for k, p in zip(d, pd, strict=True):
            assert put(store, [k], [p]) == [OK]
        assert store.remove(c[3]) == OK
        want = (want | set(d)) - {c[3]}
        before = consumer.replays
        until(lambda: consumer.keys("cpu") == want, consumer)
        assert consumer.replays > before
        blocks = {k for k in store.list_keys("kvc/", 1000)
                  if not k.rsplit("/", 1)[1].startswith("t")}
        assert consumer.keys("cpu") == blocks == want
    finally:
        consumer.close()
        store.close()


def test_disk_tier_events_follow_demotion_and_a_restart_clears_dram(
        store_cfg: StoreConfig, tmp_path: Path) -> None:
    cfg = store_cfg.with_(events=events_cfg(),
                          disk=DiskConfig(tmp_path / "disk", 64 << 20))
    store = open_store(cfg)
    consumer = RfcConsumer(cfg.local.events.endpoint, cfg.local.events.replay_endpoint)  # type: ignore[union-attr]
    try:
        keys, parents = chain("tiny", 0, 6)
        assert put(store, keys, parents) == [OK] * 6

        # every object is written back to disk (high_watermark 0): each gets a disk event
        until(lambda: consumer.keys("disk") == set(keys) and consumer.keys("cpu") == set(keys),
              consumer, act=lambda: consumer.replay(consumer.last_seq + 1))
    finally:
        consumer.close()
        store.close()
    launcher.stop(cfg)
    # a new coordinator: its first event clears DRAM; the disk tier's files are recovered
    store = open_store(cfg)
    consumer = RfcConsumer(cfg.local.events.endpoint, cfg.local.events.replay_endpoint)  # type: ignore[union-attr]
    try:
        consumer.held = {"cpu": {1: "stale"}, "disk": {}}
        until(lambda: consumer.keys("disk") == set(keys) and not consumer.keys("cpu"),
              consumer, act=lambda: consumer.replay(consumer.last_seq + 1))
    finally:
        consumer.close()
        store.close()


def test_a_hostile_replay_request_is_dropped_and_the_store_goes_on(
        store_cfg: StoreConfig) -> None:
    cfg = store_cfg.with_(events=events_cfg())
    store = open_store(cfg)
    ctx = zmq.Context()
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    consumer = RfcConsumer(cfg.local.events.endpoint, cfg.local.events.replay_endpoint)  # type: ignore[union-attr]
    try:
        bad.connect(cfg.local.events.replay_endpoint)  # type: ignore[union-attr]
        for frames in ([b"x"], [b"", b"not-8-bytes"], [b"", b"1", b"2", b"3"], [b"\0" * 2000]):
            bad.send_multipart(frames)
        keys, parents = chain("tiny", 0, 2)
        assert put(store, keys, parents) == [OK, OK]
        consumer.replay(0)  # the coordinator answered the well-formed request after them
        assert consumer.keys("cpu") == set(keys)
        assert not bad.poll(0)  # nothing answered the malformed ones
    finally:
        bad.close(0)
        ctx.term()
        consumer.close()
        store.close()


@pytest.mark.parametrize("raw, words", [
    ({"endpoint": "tcp://*:5700"}, "must be tcp://HOST:PORT"),
    ({"endpoint": "tcp://10.1.2.3:5700"}, "not a loopback address"),
    ({"endpoint": "tcp://127.0.0.1:5700", "replay_endpoint": "tcp://127.0.0.1:5700"},
     "must differ"),
    ({"endpoint": "tcp://127.0.0.1:5700", "buffer_batches": 0}, "buffer_batches"),
    ({"endpoint": "tcp://127.0.0.1:5700", "colour": "red"}, "colour"),
])
def test_bad_event_settings_are_refused_naming_them(raw: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        StoreConfig.from_dict({"events": raw})
    with pytest.raises(ValueError, match="Mooncake master publishes its own"):
        StoreConfig.from_dict({"backend": "mooncake",
                               "events": {"endpoint": "tcp://127.0.0.1:5700"}})
    ok = StoreConfig.from_dict({"events": {"endpoint": "tcp://10.1.2.3:5700",
                                           "allow_remote": True}})
    assert ok.local.events is not None and ok.local.events.allow_remote
    assert launcher.config_json(ok).count("10.1.2.3") == 1  # reaches the coordinator
