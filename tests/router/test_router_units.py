"""Router parts on their own: config, cost model, prefix index, KV event translation,
store view (a real local store), prefix heat."""

from __future__ import annotations

import asyncio
import gc
import math
import random
from collections.abc import Iterable
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio

from kvcentric.config import StoreConfig
from kvcentric.hashing import KeySpace, TailRef, block_hashes, hash_seed
from kvcentric.router import cli as router_cli
from kvcentric.router.api.access_config import LimitsConfig
from kvcentric.router.api.errors import Refused
from kvcentric.router.api.limits import InFlight
from kvcentric.router.conductor import Conductor
from kvcentric.router.config import RouterConfig, load_config
from kvcentric.router.cost.cost_model import Profile, fit, kv_bytes_per_token
from kvcentric.router.cost.decision import Rejection
from kvcentric.router.cost.profile import disk_bandwidth
from kvcentric.router.fleet.heat import PrefixHeat
from kvcentric.router.fleet.instance_spec import InstanceSpec
from kvcentric.router.fleet.kv_events import (
    EventListener,
    EventTranslator,
    apply_events,
    decode_batch,
    router_binds,
)
from kvcentric.router.fleet.prefix_index import PrefixIndex
from kvcentric.router.fleet.store_view import StoreView
from kvcentric.store import Residency, open_store
from kvcentric.store.local import launcher
from kvcentric.store.local.config import DiskConfig
from tests.helpers.disk import device_dir
from tests.helpers.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


def toks(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(4, 4000) for _ in range(n)]


# ---- config ----
def test_example_config_parses() -> None:
    cfg = load_config(REPO / "configs" / "router.yaml")
    assert cfg.model == "tiny" and len(cfg.instances) == 2
    assert cfg.store is not None
    assert cfg.store.local.autostart is False and not cfg.store.local.prefault
    assert cfg.instances[0].name == "127.0.0.1:8100" and cfg.instances[0].can_decode
    assert cfg.cost.store_bandwidth_gbps == 5 and cfg.cost.disk_bandwidth_gbps == 2


@pytest.mark.parametrize("raw, msg", [
    ({"tokenizer": "x"}, "model"),
    ({"model": "m", "tokenizer": "x", "bogus": 1}, "unknown keys"),
    ({"model": "m", "tokenizer": "x", "slo": {"ttft_ms": 0}}, "ttft_ms"),
    ({"model": "m", "tokenizer": "x", "instances": [{"url": "ftp://a"}]}, "http"),
    ({"model": "m", "tokenizer": "x", "instances": [{"url": "http://a:1", "role": "x"}]},
     "role"),
    ({"model": "m", "tokenizer": "x", "instances": [{"url": "http://a:1"},
                                                    {"url": "http://a:1"}]}, "unique"),
    ({"model": "m", "tokenizer": "x", "keys": {"layout_sig": "nothex"}}, "layout_sig"),
    ({"model": "m", "tokenizer": "x", "store": {"backend": "redis"}}, "backend"),
    ({"model": "m", "tokenizer": "x", "cost": {"disk_bandwidth_gbps": 0}}, "disk_bandwidth"),
])
def test_bad_config_is_a_clear_error(raw: dict[str, object], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        RouterConfig.from_dict(raw)


def test_instance_spec_checks_types() -> None:
    with pytest.raises(ValueError, match="string"):
        InstanceSpec.from_dict({"url": 5})
    with pytest.raises(ValueError, match="kv_events"):
        InstanceSpec(url="http://h:1", kv_events="udp://x")


# ---- cost model ----
def test_fit_recovers_the_flops_model() -> None:
    a, b, c = 2e-8, 3e-4, 0.02
    rng = np.random.default_rng(0)
    pts = []
    for n in (256, 512, 1024, 2048, 4096):
        for f in (0.0, 0.5, 0.9):
            h = int(n * f)
            t = a * (n * n - h * h) + b * (n - h) + c
            pts.append((n, h, t * (1 + rng.normal(0, 0.01))))
    prof = fit(pts)
    assert prof.a == pytest.approx(a, rel=0.1)
    assert prof.b == pytest.approx(b, rel=0.1)
    assert prof.r2 is not None and prof.r2 > 0.99
    # the uncached part is what costs: more hit, less time; full hit still recomputes a token
    assert prof.prefill_s(4096, 0) > prof.prefill_s(4096, 2048) > prof.prefill_s(4096, 4096)
    last = prof.a * (4096**2 - 4095**2) + prof.b + prof.c  # the last token attends to all
    assert prof.prefill_s(4096, 4096) == pytest.approx(last, rel=1e-9)


def test_fit_keeps_coefficients_non_negative() -> None:
    pts = [(n, 0, 0.05 + 1e-5 * n - 1e-12 * n * n) for n in (100, 1000, 5000, 9000)]
    prof = fit(pts)
    assert prof.a >= 0 and prof.b >= 0 and prof.c >= 0


def test_profile_round_trip_and_validation(tmp_path: Path) -> None:
    prof = fit([(100, 0, 0.1), (200, 0, 0.2), (400, 0, 0.4)], model="m", tbt_base_s=0.01)
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof
    with pytest.raises(ValueError, match=">= 0"):
        Profile(a=-1.0)
    assert math.isinf(Profile().tbt_s(1, kv_usage=0.99))
    assert Profile(tbt_base_s=0.01, tbt_per_seq_s=0.002).tbt_s(6) == pytest.approx(0.02)
    with_disk = fit([(100, 0, 0.1), (200, 0, 0.2), (400, 0, 0.4)], disk_bandwidth_bps=1.5e9)
    with_disk.save(tmp_path / "d.json")
    assert Profile.load(tmp_path / "d.json").disk_bandwidth_bps == 1.5e9
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="disk_bandwidth_bps must be > 0"):
            Profile(disk_bandwidth_bps=bad)


def test_disk_probe_counts_only_reads_that_reach_a_device(caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    """tmpfs never reaches a device: no bandwidth is recorded (it would promise memory
    speed for the disk tier); a block device gives a finite one, its file removed."""
    shm = Path("/dev/shm")
    if shm.is_dir():
        with caplog.at_level("WARNING"):
            assert disk_bandwidth(shm, 4 << 20, reps=1) is None
        assert "not recorded" in caplog.text
    with device_dir() as d:  # on the checkout's disk: a tmpfs tmp dir reaches no device
        bw = disk_bandwidth(d, 16 << 20, reps=2)
        left = list(d.iterdir())
    if bw is None:
        pytest.skip(f"no block device with I/O accounting under {d.parent}")
    assert 0 < bw < math.inf and not left


def test_profile_command_refuses_a_missing_disk_path(capsys: pytest.CaptureFixture[str]) -> None:
    code = router_cli.main(["profile", "--url", "http://127.0.0.1:9", "--model", "m",
                            "--out", "/tmp/unused.json", "--disk-path", "/nonexistent/kvc"])
    assert code == 2 and "not a directory" in capsys.readouterr().err


def test_kv_bytes_per_token_from_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,'
        ' "head_dim": 64, "hidden_size": 256, "torch_dtype": "float32"}')
    assert kv_bytes_per_token(tmp_path) == 2 * 4 * 2 * 64 * 4
    assert kv_bytes_per_token(tmp_path, "bfloat16") == 2 * 4 * 2 * 64 * 2
    with pytest.raises(ValueError, match="cannot read"):
        kv_bytes_per_token(tmp_path / "missing")


# ---- prefix index ----
def test_index_match_is_per_instance_leading_run() -> None:
    idx = PrefixIndex()
    for s in range(3):
        idx.add_slot(s, 100)
    chain = block_hashes(toks(1, 256 * 6), 256, hash_seed("m"))
    idx.add(0, chain[:4])
    idx.add(1, chain[:2])
    idx.add(2, chain[1:5])  # no root: useless, a prefix must start at block 0
    assert idx.match(chain, 0b111) == {0: 4, 1: 2, 2: 0}
    assert idx.match(chain, 0b010) == {1: 2}
    idx.remove(0, [chain[2]])
    assert idx.match(chain, 0b001) == {0: 2}
    idx.clear(1)
    assert idx.match(chain, 0b011) == {0: 2, 1: 0}
    assert idx.owners(chain[0]) == 0b001


def test_index_lru_evicts_leaves_before_roots() -> None:
    idx = PrefixIndex()
    idx.add_slot(0, 4)
    a = block_hashes(toks(2, 256 * 3), 256, hash_seed("m"))
    b = block_hashes(toks(3, 256 * 3), 256, hash_seed("m"))
    idx.add(0, a)
    idx.add(0, b[:1])  # 4 blocks: full
    idx.add(0, b[:2])  # one more: a's deepest block goes first, not its root
    assert idx.match(a, 1) == {0: 2} and idx.match(b, 1) == {0: 2}
    idx.set_capacity(0, 2)
    assert idx.resident(0) == 2 and idx.match(b, 1) == {0: 2}
    idx.drop_slot(0)
    assert idx.owners(b[0]) == 0


# ---- KV events ----
def _stored(hashes: list[int], parent: int | None, tokens: list[int], page: int = 128,
            salt: str | None = None) -> dict[str, object]:
    extra = [[salt]] + [None] * (len(hashes) - 1) if salt else None
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": page, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": extra}


def test_translator_recomputes_our_block_hashes_from_pages() -> None:
    t = toks(4, 128 * 5)
    want = block_hashes(t, 256, hash_seed("tiny"))  # 2 full stored blocks
    tr = EventTranslator("tiny", 256)
    assert tr.stored(_stored([11], None, t[:128])) == []  # half a block: nothing yet
    assert tr.stored(_stored([12, 13, 14], 11, t[128:512])) == want
    assert tr.stored(_stored([15], 14, t[512:640])) == []
    # a continuation that forks after page 13 completes its own block
    fork = t[:384] + toks(5, 128)
    assert tr.stored(_stored([16], 13, fork[384:512])) == \
        block_hashes(fork, 256, hash_seed("tiny"))[1:]
    # losing the first page of block 1 breaks it (and the fork's block 1)
    assert set(tr.removed({"type": "BlockRemoved", "block_hashes": [13]})) == \
        {want[1], block_hashes(fork, 256, hash_seed("tiny"))[1]}
    assert tr.stored(_stored([20], 999, t[:128])) == [] and tr.skipped == 1  # unknown parent


class _Removals(PrefixIndex):
    """A prefix index that records each removal it is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.removals: list[list[bytes]] = []

    def remove(self, slot: int, hashes: Iterable[bytes]) -> None:
        self.removals.append(list(hashes))  # consumed once: an iterator passes on intact
        super().remove(slot, self.removals[-1])


def test_a_run_of_page_removals_is_one_removal_in_the_engines_order() -> None:
    """vLLM sends one BlockRemoved per page: a run of them reaches the index as one
    removal naming each of our blocks once; what the batch does after the run (the
    pages stored again, the cache cleared) is applied after it."""
    t = toks(9, 128 * 4)
    want = block_hashes(t, 256, hash_seed("tiny"))  # block 0: pages 1-2, block 1: 3-4
    tr, index = EventTranslator("tiny", 256), _Removals()
    index.add_slot(0, 64)
    apply_events(tr, index, 0, [_stored([1, 2, 3, 4], None, t)])
    assert index.match(want, 1) == {0: 2}
    gone = [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"} for h in (4, 3, 2)]
    apply_events(tr, index, 0, [*gone, _stored([2, 3, 4], 1, t[128:])])
    assert index.match(want, 1) == {0: 2}  # removed, then stored again
    assert len(index.removals) == 1 and sorted(index.removals[0]) == sorted(want)
    apply_events(tr, index, 0, [_stored([5], 4, toks(10, 128)), *gone])
    assert index.match(want, 1) == {0: 0} and len(index.removals) == 2
    apply_events(tr, index, 0, [_stored([1, 2], None, t[:256]), {"type": "AllBlocksCleared"}])
    assert index.resident(0) == 0 and len(tr) == 0


def test_the_translators_live_pages_are_not_one_tracked_object_each() -> None:
    """Every full collection visits every object the collector tracks, and full
    collections come more often the more long-lived ones are made: a router holds
    hundreds of thousands of engine pages, which must not be one tracked object each."""
    gc.collect()
    before = len(gc.get_objects())
    tr, parent = EventTranslator("tiny", 256), None
    for e in range(16):
        hashes = list(range(e * 256 + 1, e * 256 + 257))
        assert len(tr.stored(_stored(hashes, parent, toks(e, 128 * 256)))) == 128
        parent = hashes[-1]
    gc.collect()
    assert len(tr) == 4096
    assert len(gc.get_objects()) - before < 4096 // 8


def test_translator_uses_the_cache_salt_like_the_connector() -> None:
    t = toks(6, 256)
    tr = EventTranslator("tiny", 256)
    got = tr.stored(_stored([1, 2], None, t, salt="tenant"))
    assert got == block_hashes(t, 256, hash_seed("tiny", "tenant"))
    assert got != block_hashes(t, 256, hash_seed("tiny"))


def test_translator_reads_sglangs_events() -> None:
    """SGLang's events as its publisher encodes them (the emulator's, byte-identical to
    SGLang's structs: tests/bench/test_emulator_wire.py): one page each, signed int64
    hashes, the salt in ``cache_salt`` on every page; a host tier's copy (``CPU_PINNED``)
    is not GPU residency, and its removal does not remove the GPU's."""
    from benchmarks.emulator import events as emu

    t = toks(8, 512)
    pages = [emu.sglang_stored(2**64 - 1 - i, None if i == 0 else 2**64 - i, t[i * 128:
                               (i + 1) * 128], "tenant") for i in range(4)]
    events = decode_batch(emu.encode_batch(pages, kind="sglang"))
    tr = EventTranslator("tiny", 256)
    got = [h for ev in events for h in tr.stored(ev)]
    assert got == block_hashes(t, 256, hash_seed("tiny", "tenant"))
    host = {**events[0], "medium": "CPU_PINNED"}
    assert tr.stored(host) == [] and tr.other_media == 1
    assert tr.removed({"type": "BlockRemoved", "block_hashes": host["block_hashes"],
                       "medium": "CPU_PINNED"}) == [] and tr.other_media == 2
    assert tr.removed({"type": "BlockRemoved", "block_hashes": events[3]["block_hashes"],
                       "medium": "GPU"}) == got[1:]
    assert tr.skipped == 0


def test_event_listener_over_zmq_with_vllm_framing() -> None:
    """The engine side exactly as vLLM's ZmqEventPublisher: PUB connects to a
    tcp://127.0.0.1 endpoint, frames (topic, seq u64 BE, msgpack [ts, events, rank])."""
    t = toks(7, 512)
    got: list[list[dict[str, object]]] = []

    async def run() -> EventListener:
        ctx = zmq.asyncio.Context()
        port = _free_port()
        ep = f"tcp://127.0.0.1:{port}"
        assert router_binds(ep) and not router_binds("ipc:///tmp/x")
        lst = EventListener(ctx, ep, got.append)
        task = asyncio.get_running_loop().create_task(lst.run())
        pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        pub.connect(ep)
        enc = msgspec.msgpack.Encoder()
        for seq in (0, 1, 3):  # batch 2 lost on the way
            batch = [1.0, [_stored([seq * 10 + 1], None, t[:128])], None]
            for _ in range(100):  # PUB drops until the connection is up: resend seq 0
                pub.send_multipart([b"kv", seq.to_bytes(8, "big"), enc.encode(batch)])
                await asyncio.sleep(0.02)
                if got and (seq == 0 or lst.batches >= (2 if seq == 1 else 3)):
                    break
        pub.close(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.term()
        return lst

    lst = asyncio.run(run())
    assert got and got[0][0]["type"] == "BlockStored"
    assert lst.gaps >= 1
    with pytest.raises(ValueError):
        decode_batch(b"\xc1garbage")


def _free_port() -> int:
    from kvcentric.testing.servers import free_port

    return free_port()


# ---- store view on a real local store ----
def test_store_view_leading_run_with_ttl(store_cfg: StoreConfig) -> None:
    clock = [100.0]
    t = toks(8, 256 * 5)
    hashes = block_hashes(t, 256, hash_seed("tiny"))
    ks = KeySpace("tiny", "0123456789abcdef")
    store = open_store(store_cfg)
    try:
        keys = ks.keys(hashes[:3])
        buf = np.zeros(64, np.uint8)
        assert store.batch_put_from(keys, [buf.ctypes.data] * 3, [64] * 3) == [0, 0, 0]
        cfg = store_cfg.with_(autostart=False, prefault=False)
        view = StoreView(cfg, "tiny", ttl_s=2.0, negative_ttl_s=0.5, clock=lambda: clock[0])
        assert view.query(hashes) == 3 and view.layout_sig == "0123456789abcdef"  # discovered
        assert view.cached_run(hashes) == (3, True) and view.queries == 1
        store.remove(keys[2], force=True)
        assert view.cached_run(hashes) == (3, True)  # still trusted within the TTL
        clock[0] += 3.0
        assert view.cached_run(hashes) == (0, False)
        assert asyncio.run(view.leading_run(hashes)) == 2 and view.queries == 2
        assert view._pool is None  # answered from the shared index, on the loop
        view.close()
    finally:
        store.close()


def test_store_view_survives_a_missing_store(tmp_path: Path) -> None:
    cfg = StoreConfig.from_dict({"name": "nothere", "runtime_dir": tmp_path, "autostart": False,
                                 "prefault": False})
    view = StoreView(cfg, "tiny", layout_sig="0123456789abcdef")
    hashes = block_hashes(toks(9, 512), 256, hash_seed("tiny"))
    assert view.query(hashes) == 0 and view.errors == 1
    assert StoreView(None, "tiny").cached_run(hashes) == (0, True)


def test_store_view_caches_each_blocks_tier(store_cfg: StoreConfig, tmp_path: Path) -> None:
    """A restarted disk-tier store holds everything on disk only (recovered): the view
    reports and caches that per block; a read promotes a block, seen after the TTL."""
    cfg = store_cfg.with_(capacity_bytes=16 << 20,
                          disk=DiskConfig(tmp_path / "disk", 64 << 20, high_watermark=0.001))
    hashes = block_hashes(toks(10, 256 * 5), 256, hash_seed("tiny"))
    keys = KeySpace("tiny", "0123456789abcdef").keys(hashes[:3])
    buf = np.zeros(64 << 10, np.uint8)  # each over 0.1% of DRAM: all demoted at once
    with open_store(cfg) as store:
        assert store.batch_put_from(keys, [buf.ctypes.data] * 3, [buf.nbytes] * 3,
                                    [None, *keys[:2]]) == [0, 0, 0]
        assert wait_until(lambda: store.stats()["demotions"] == 3, 20.0)
    launcher.stop(cfg)  # the files stay; a new coordinator recovers them, disk-only
    store = open_store(cfg)
    clock = [100.0]
    view = StoreView(cfg.with_(autostart=False, prefault=False), "tiny",
                     layout_sig="0123456789abcdef", clock=lambda: clock[0])
    try:
        assert wait_until(lambda: store.stats()["recovered"] == 3, 20.0)
        assert view.query(hashes) == 3 and view.queries == 1
        assert asyncio.run(view.residency(hashes)) == Residency(3, (0, 1, 2))  # cached
        assert view.queries == 1 and view.cached_disk(hashes[1:], 2) == (0, 1)
        got = np.zeros_like(buf)
        assert store.batch_get_into(keys[:1], [got.ctypes.data], [got.nbytes]) == [got.nbytes]
        assert wait_until(lambda: store.stats()["promotions"] == 1, 10.0)
        assert asyncio.run(view.residency(hashes)) == Residency(3, (0, 1, 2))  # within TTL
        clock[0] += 3.0
        assert asyncio.run(view.residency(hashes)) == Residency(3, (1, 2))
        assert asyncio.run(view.leading_run(hashes)) == 3 and view.queries == 2
        assert view._pool is not None  # tiers take a call: on the view's thread
    finally:
        view.close()
        store.close()


def test_conductor_costs_store_blocks_by_their_tier(tmp_path: Path) -> None:
    """One cached store lookup gives the run and each block's tier: blocks on disk only
    load at disk_bandwidth_gbps, the rest at store_bandwidth_gbps."""
    cfg = RouterConfig.from_dict({
        "model": "tiny", "tokenizer": "x", "keys": {"block_size": 256},
        "store": {"name": "unused", "runtime_dir": str(tmp_path), "autostart": False},
        "cost": {"store_bandwidth_gbps": 1, "disk_bandwidth_gbps": 0.25}})
    assert cfg.store is not None
    view = StoreView(cfg.store, "tiny", layout_sig="0123456789abcdef", clock=lambda: 0.0)
    c = Conductor(cfg, Profile(), 4096, view, clock=lambda: 0.0)
    c.registry.add(InstanceSpec(url="http://a:1", name="a"))
    tokens = toks(11, 256 * 8 + 10)
    hashes = c.hashes(tokens)
    tail = c.tail(tokens, hashes)
    assert tail is not None and len(hashes) == 8
    items: list[bytes | TailRef] = [*hashes, tail]
    loads = {}
    for disk_only in ((), (2, 3, 8)):  # two blocks and the tail on disk only
        view.reset()
        view.record(items, 0, 9, 0.0, disk_only)  # the whole answer: no store call
        d = asyncio.run(c.decide(hashes, len(tokens), tail=tail))
        assert not isinstance(d, Rejection) and d.hit_tokens == len(tokens) - 1
        assert d.load_on_disk == len(disk_only)
        loads[disk_only] = d.candidates[0].load_s
    obj = 4096 * 256
    assert loads[()] == pytest.approx(9 * obj / 1e9)
    assert loads[(2, 3, 8)] - loads[()] == pytest.approx(3 * obj * (1 / 0.25e9 - 1 / 1e9))
    assert view.queries == 0
    # a profiled disk bandwidth overrides the configured one
    profiled = Conductor(cfg, Profile(disk_bandwidth_bps=0.5e9), 4096, view, clock=lambda: 0.0)
    assert profiled.disk_bandwidth == 0.5e9 and profiled.params.disk_bandwidth_bps == 0.5e9
    view.close()


def test_a_dispatched_store_load_queues_with_its_prefill() -> None:
    """The instance is busy for the load and then the compute, so both queue ahead of the
    next request there: counting only the compute let a router pile long-context
    requests, each mostly a load, onto one instance."""
    cfg = RouterConfig.from_dict({"model": "tiny", "tokenizer": "x",
                                  "keys": {"block_size": 256},
                                  "cost": {"store_bandwidth_gbps": 1}})
    c = Conductor(cfg, Profile(b=1e-4, c=0.01), 4096, StoreView(None, "tiny"),
                  clock=lambda: 0.0)
    for n in ("a", "b"):
        c.registry.add(InstanceSpec(url=f"http://{n}:1", name=n))
    hashes = c.hashes(toks(12, 256 * 8 + 10))
    d = c.decide_local(hashes, 256 * 8 + 10, global_run=8)
    assert not isinstance(d, Rejection)
    assert d.load_s == pytest.approx(8 * 4096 * 256 / 1e9) and d.prefill_s > 0
    assert d.work_s == d.load_s + d.prefill_s
    c.dispatched(d, "r1", hashes)
    assert d.prefill.queue_s(0.0) == pytest.approx(d.work_s)
    # the next prompt from the store goes to the other instance, and its TTFT there
    # does not include the first one's queue
    e = c.decide_local(c.hashes(toks(13, 256 * 8 + 10)), 256 * 8 + 10, global_run=8)
    assert not isinstance(e, Rejection) and e.prefill is not d.prefill


def test_the_rest_of_a_scanned_prompt_counts_where_its_request_went() -> None:
    """A prompt dispatched on its first blocks (a scan that stopped short): its whole
    hashes, given later, are resident on its prefill and decode instances, so the next
    request sharing it predicts hits there; an instance dropped meanwhile (its slot
    reused by another) gets nothing."""
    cfg = RouterConfig.from_dict({"model": "tiny", "tokenizer": "x",
                                  "keys": {"block_size": 16}})
    c = Conductor(cfg, Profile(b=1e-4, c=0.01), 4096, StoreView(None, "tiny"),
                  clock=lambda: 0.0)
    for n, role in (("p", "prefill"), ("d", "decode"), ("x", "both")):
        c.registry.add(InstanceSpec(url=f"http://{n}:1", name=n, role=role))
    full = c.hashes(toks(21, 16 * 40))
    d = c.decide_local(full[:3], 16 * 40, global_run=0, exclude={"x"})
    assert not isinstance(d, Rejection) and d.disaggregated
    c.dispatched(d, "r1", full[:3])
    match = c.index.match(full, (1 << d.prefill.slot) | (1 << d.decode.slot))
    assert match == {d.prefill.slot: 3, d.decode.slot: 3}
    c.resident_beyond_scan(d, "r1", full)
    match = c.index.match(full, (1 << d.prefill.slot) | (1 << d.decode.slot))
    assert match == {d.prefill.slot: 40, d.decode.slot: 40}
    # the prefill instance is replaced (same name, a new instance in its slot)
    slot = d.prefill.slot
    c.registry.remove("p")
    q = c.registry.add(InstanceSpec(url="http://q:1", name="p", role="prefill"))
    assert q.slot == slot
    c.resident_beyond_scan(d, "r1", c.hashes(toks(22, 16 * 40)))
    assert c.index.match(c.hashes(toks(22, 16 * 40)), 1 << slot) == {slot: 0}


# ---- heat ----
def test_prefix_heat_decays_and_ranks() -> None:
    h = PrefixHeat(half_life_s=10.0, max_keys=4)
    for _ in range(4):
        h.touch(b"a", 0.0)
    h.touch(b"b", 0.0)
    assert h.get(b"a", 10.0) == pytest.approx(2.0)
    assert [k for k, _ in h.top(2, 10.0)] == [b"a", b"b"]
    for i in range(10):
        h.touch(bytes([i]), 1.0)
    assert len(h._heat) <= 4


def test_prefix_heat_forgets_cold_prefixes_so_its_memory_stays_bounded() -> None:
    """A new root every 0.1 s for 500 half-lives (a conversation workload): the table
    keeps the roots of the last few half-lives, not every root ever seen (it kept up to
    max_keys, 10,000: ~1.6 MiB that a soak's router grew by until it got there); a prefix
    that stays hot is counted exactly as without forgetting."""
    h = PrefixHeat(half_life_s=1.0)
    ref = PrefixHeat(half_life_s=1.0, forget_below=0.0)  # forgets nothing
    for i in range(5000):
        now = i * 0.1
        for heat in (h, ref):
            heat.touch(i.to_bytes(4, "big"), now)
            if i % 5 == 0:
                heat.touch(b"hot", now)
    # 10 roots per half-life, kept while above 1/16 (4 half-lives) + one sweep interval
    assert len(h) <= 55 and len(ref) == 5001
    assert h.top(1, now)[0] == ref.top(1, now)[0] == (b"hot", pytest.approx(ref.get(b"hot", now)))
    assert [k for k, _ in h.top(10, now)] == [k for k, _ in ref.top(10, now)]


def test_conductor_keeps_no_state_per_cache_salt() -> None:
    """Hashing prompts of ever new cache salts (per user, per request) leaves the
    conductor's containers as they were: it cached one seed per salt ever seen."""
    cfg = RouterConfig.from_dict({"model": "tiny", "tokenizer": "x",
                                  "keys": {"block_size": 256}})
    c = Conductor(cfg, Profile(), 4096, StoreView(None, "tiny"))

    def sizes() -> dict[str, int]:
        return {k: len(v) for k, v in vars(c).items() if isinstance(v, (dict, set, list))}

    tokens = toks(12, 256 * 3 + 7)
    before = sizes()
    for i in range(1000):
        salt = f"user-{i}"
        hashes = c.hashes(tokens, salt)
        assert hashes == block_hashes(tokens, 256, hash_seed("tiny", salt))
        assert c.tail(tokens, hashes, salt) is not None
    assert sizes() == before


# ---- command line ----
def test_cli_reports_bad_input_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvcentric.router.cli import main

    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "No such file" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny\ntokenizer: x\nslo: {ttft_ms: -1}\n")
    assert main(["serve", "--config", str(bad)]) == 2
    assert "ttft_ms" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["profile", "--url", "http://x", "--model", "m", "--out", "o", "--hits", "1.5"])


def test_store_view_sweeps_expired_answers_so_its_memory_stays_bounded() -> None:
    view = StoreView(None, "tiny", ttl_s=2.0, negative_ttl_s=0.5)
    old = [bytes([i % 256, i // 256]) for i in range(5000)]
    view.record(old, 0, 4999, now=0.0, disk_only=(1, 2, 3))
    assert len(view._present) == 4999 and len(view._disk) == 3
    view.record([b"new", b"next"], 0, 1, now=5 * 2.0 + 0.1)  # five TTLs later: a sweep
    assert set(view._present) == {b"new"} and set(view._absent) == {b"next"}
    assert not view._disk  # disk marks go with their answers


def test_in_flight_bound_is_the_smaller_of_per_key_and_per_instance_times_the_fleet() -> None:
    """The per-instance bound is read at each admission, so it follows the fleet; a
    per-key bound caps it; neither set: no bound."""
    fleet = [3]
    inflight = InFlight(LimitsConfig(max_concurrency_per_instance=2), lambda: fleet[0])
    for _ in range(6):
        inflight.acquire("k")
    with pytest.raises(Refused, match=r"\(limit 6\)"):
        inflight.acquire("k")
    inflight.acquire("other")  # each budget its own
    fleet[0] = 4  # an instance joined: two more slots
    inflight.acquire("k")
    inflight.acquire("k")
    with pytest.raises(Refused):
        inflight.acquire("k")
    fleet[0] = 0  # no instance known yet: one instance's worth, not nothing
    assert inflight.limit() == 2
    capped = InFlight(LimitsConfig(max_concurrency_per_key=5,
                                   max_concurrency_per_instance=2), lambda: 16)
    assert capped.limit() == 5
    free = InFlight(LimitsConfig(max_concurrency_per_instance=None), lambda: 16)
    for _ in range(10_000):
        free.acquire("k")
    assert free.limit() is None
    with pytest.raises(ValueError, match="max_concurrency_per_instance"):
        LimitsConfig(max_concurrency_per_instance=0)
