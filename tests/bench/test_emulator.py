"""The engine emulator: its timing model, page cache, KV event replay endpoint (read back
by the router's own listener), processor sharing, store hits and its OpenAI/metrics
surface (one emulator process, a few engines). Its event batches against vLLM's own
bytes: tests/bench/test_emulator_wire.py (it imports vLLM; the parallel pass)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio

from benchmarks.emulator import events as ev
from benchmarks.emulator import processors
from benchmarks.emulator.calibrate import emulator_spec, interference
from benchmarks.emulator.connector import StoreHits
from benchmarks.emulator.engine import EngineCore, Request, predict_alone
from benchmarks.emulator.launch import EmulatedFleet, EmulatorSpec
from benchmarks.emulator.measure import (
    interference_of,
    keep_measured_apart,
    prefill_shapes,
    sourced,
)
from benchmarks.emulator.pages import PageCache, SeqPages
from benchmarks.emulator.processors import ExclusiveProcessor, Processor
from benchmarks.emulator.profile import DecodePoint, EngineProfile, PrefillPoint, fit, load
from kvcentric.config import StoreConfig
from kvcentric.hashing import block_hashes, hash_seed
from kvcentric.router.fleet.kv_events import EventListener, EventTranslator, decode_batch
from kvcentric.store import open_store
from kvcentric.store.local import launcher
from kvcentric.testing.models import build_model
from tests.helpers.virtual_time import VirtualClock
from tests.helpers.virtual_time import run as vrun
from tests.helpers.waiting import wait_until

# serial (tests/helpers/xdist_groups.py): emulated times are held to tens of milliseconds
pytestmark = pytest.mark.serial

PROF = EngineProfile("t", "test", api_s=0.01, step_s=0.02, prefill_token_s=5e-4,
                     prefill_pair_s=1e-7, decode_seq_s=1e-3, decode_ctx_s=1e-6,
                     page_size=16, max_num_batched_tokens=256, max_num_seqs=8)


def toks(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(10, 8000) for _ in range(n)]


# ------------------------------------------------------------------------- timing model

def test_a_lone_prefill_is_api_plus_its_chunked_steps() -> None:
    n = 600  # three chunks of the 256-token budget
    want = PROF.api_s + sum(PROF.step_time([(c, ctx)], []) for c, ctx in
                            ((256, 0), (256, 256), (88, 512)))
    assert PROF.prefill_alone_s(n) == pytest.approx(want)
    assert predict_alone(PROF, [(0.0, n, 0, 1)])["ttft_s"][0] == pytest.approx(want)


def test_decodes_share_steps_and_prefills_wait_for_the_token_budget() -> None:
    # four prompts of 200 tokens arriving together: the 256-token budget serves one and
    # a bit per step, so later ones wait; then all decode in one batch per step
    out = predict_alone(PROF, [(0.0, 200, 0, 4)] * 4)
    ttft = out["ttft_s"]
    assert ttft == sorted(ttft) and ttft[0] < ttft[-1]
    gap = out["e2e_s"][-1] - ttft[-1]  # its 3 more tokens: decode steps of 1 to 4 sequences
    assert 3 * PROF.itl_s(1, 201) <= gap <= 3 * PROF.itl_s(4, 203) + 1e-9


def test_fit_recovers_the_coefficients_it_was_made_from() -> None:
    pre = [PrefillPoint(n, h, PROF.prefill_alone_s(n, h))
           for n in (64, 300, 600, 1000) for h in (0, n // 2)]
    dec = [DecodePoint(b, c, PROF.itl_s(b, c)) for b in (1, 4, 8) for c in (100, 1000)]
    got = fit(pre, dec, name="t", source="test", page_size=16, max_num_batched_tokens=256)
    assert got.fit["relative_error_max"] < 1e-6
    for k in ("api_s", "step_s", "prefill_token_s", "prefill_pair_s", "decode_seq_s"):
        assert getattr(got, k) == pytest.approx(getattr(PROF, k), rel=1e-3)


def test_committed_profiles_load_and_are_sane() -> None:
    for name in ("vllm_cpu_bench", "h100_llama8b"):
        p = load(name)
        assert p.source and p.prefill_alone_s(2048) > p.prefill_alone_s(2048, 1920)
        assert p.itl_s(32) >= p.itl_s(1) > 0
    with pytest.raises(ValueError):
        EngineProfile.from_json({**load("vllm_cpu_bench").to_json(), "step_s": -1})


# --------------------------------------------------------------------------- page cache

def test_pages_hit_leading_runs_and_evict_least_recently_freed_first() -> None:
    cache = PageCache(8, 16)
    a = SeqPages(toks(1, 64), None)  # 4 pages
    assert cache.match(a) == 0 and cache.admit(a, 0, 64)
    cache.commit(a, 64)
    stored = cache.take_events()
    assert [type(e).__name__ for e in stored] == ["BlockStored"]
    assert len(stored[0].block_hashes) == 4 and stored[0].parent_block_hash is None
    cache.release(a)
    again = SeqPages(toks(1, 64), None)
    assert cache.match(again) == 3  # the last token is always computed
    b = SeqPages(toks(2, 112), None)  # 7 pages: evicts a's pages, last page first
    assert cache.admit(b, 0, 112)
    gone = [e.block_hashes[0] for e in cache.take_events() if isinstance(e, ev.BlockRemoved)]
    assert gone == list(reversed(a.hashes(16)))[:3]
    assert cache.kv_usage == pytest.approx(7 / 8)
    assert not cache.admit(SeqPages(toks(3, 64), None), 0, 64)  # no room: waits


def test_the_router_rebuilds_what_the_engine_cached_from_its_events() -> None:
    """The emulator's BlockStored/BlockRemoved, decoded and translated by the router's own
    code, name exactly the router's blocks of the cached pages."""
    cache = PageCache(64, 16)
    tr = EventTranslator("bench", 32)
    prompt = toks(4, 100)
    seq = SeqPages(prompt, "s1")
    cache.admit(seq, 0, 100)
    cache.commit(seq, 100)
    blocks: set[bytes] = set()
    for e in decode_batch(ev.encode_batch(cache.take_events())):
        assert e["type"] == "BlockStored"
        blocks.update(tr.stored(e))
    assert blocks == set(block_hashes(prompt[:96], 32, hash_seed("bench", "s1")))


# ---------------------------------------------------------------------- wire and replay

def test_a_late_listener_replays_the_publishers_buffer_then_follows_live() -> None:
    from kvcentric.testing.servers import free_port

    live, replay = f"tcp://*:{free_port()}", f"tcp://*:{free_port()}"

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        pub = ev.Publisher(ctx, live, replay)
        pub.start()
        cache = PageCache(64, 16)
        prompts = [toks(10 + i, 48) for i in range(3)]
        for p in prompts:  # published before anyone listens
            s = SeqPages(p, None)
            cache.admit(s, 0, 48)
            cache.commit(s, 48)
            pub.publish(cache.take_events())
        tr = EventTranslator("bench", 16)
        seen: set[bytes] = set()

        def on_events(evs: list[dict[str, Any]]) -> None:
            for e in evs:
                seen.update(tr.stored(e))

        lst = EventListener(ctx, live.replace("*", "127.0.0.1"), on_events, bind=False,
                            replay=replay.replace("*", "127.0.0.1"))
        task = asyncio.get_running_loop().create_task(lst.run())
        want = {h for p in prompts for h in block_hashes(p, 16, hash_seed("bench"))}
        for _ in range(200):
            if seen >= want:
                break
            await asyncio.sleep(0.02)
        assert seen == want and lst.replayed == 3
        later = toks(20, 48)
        s = SeqPages(later, None)
        cache.admit(s, 0, 48)
        cache.commit(s, 48)
        batch = cache.take_events()
        for _ in range(100):  # the SUB's connection may still be forming
            pub.publish(batch)
            await asyncio.sleep(0.05)
            if set(block_hashes(later, 16, hash_seed("bench"))) <= seen:
                break
        assert set(block_hashes(later, 16, hash_seed("bench"))) <= seen
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close()
        lst.close()
        ctx.term()

    asyncio.run(run())


# ------------------------------------------------------------------ processors, store

@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    """Virtual time for the processors (tests/helpers/virtual_time.py): the durations
    below are exact, whatever the load on this machine or a pause of this process."""
    c = VirtualClock()
    monkeypatch.setattr(processors, "time", c.module)
    return c


EXACT = 1e-9  # virtual time: only float rounding between expected and measured


def test_engines_on_one_processor_share_it(clock: VirtualClock) -> None:
    async def run(shared: bool) -> float:
        p1 = Processor()
        p2 = p1 if shared else Processor()
        t0 = clock.now
        await asyncio.gather(p1.run(0.2), p2.run(0.2))
        return clock.now - t0

    assert vrun(run(False), clock) == pytest.approx(0.2, abs=EXACT)
    assert vrun(run(True), clock) == pytest.approx(0.4, abs=EXACT)


def test_engines_on_cores_of_one_host_slow_each_other_by_the_interference(
        clock: VirtualClock) -> None:
    """Processor(interference=x): two steps of 0.2 s together take 0.2 * (1 + x); once
    one is done the other runs at full speed, so a 0.1 s step next to a 0.3 s one ends
    at 0.1 * (1 + x) and the long one 0.1 * x later than alone."""
    async def run(x: float, a: float, b: float) -> tuple[float, float]:
        p = Processor(interference=x)
        t0 = clock.now
        ends: list[float] = []

        async def one(w: float) -> None:
            await p.run(w)
            ends.append(clock.now - t0)

        await asyncio.gather(one(a), one(b))
        return ends[0], ends[1]

    assert vrun(run(0.5, 0.2, 0.2), clock)[1] == pytest.approx(0.3, abs=EXACT)
    assert vrun(run(0.0, 0.2, 0.2), clock)[1] == pytest.approx(0.2, abs=EXACT)
    short, long_ = vrun(run(1.5, 0.1, 0.3), clock)
    assert short == pytest.approx(0.25, abs=EXACT)
    assert long_ == pytest.approx(0.45, abs=EXACT)
    with pytest.raises(ValueError):
        Processor(interference=-0.1)
    with pytest.raises(ValueError):
        EngineProfile.from_json({**load("vllm_cpu_bench").to_json(), "host_interference": -1})


def test_each_step_draws_its_interference_from_the_measured_samples(
        clock: VirtualClock) -> None:
    """Processor(samples=...): every step draws its own x (seeded), so two 0.1 s steps
    together end at 0.1 s each with draws (0, 0), at 0.4 s with (3, 3), and with (0, 3)
    at 0.1 s and 0.175 s (a quarter of the slowed one done while the other ran, the rest
    alone); a lone step is never slowed."""
    async def pair(p: Processor) -> list[float]:
        t0 = clock.now

        async def one() -> float:
            await p.run(0.1)
            return clock.now - t0

        return sorted(await asyncio.gather(one(), one()))

    async def pairs(seed: int, n: int) -> list[list[float]]:
        p = Processor(samples=(0.0, 3.0), seed=seed)
        return [await pair(p) for _ in range(n)]

    ends: dict[tuple[float, ...], list[float]] = {
        (0.0, 0.0): [0.1, 0.1], (3.0, 3.0): [0.4, 0.4], (0.0, 3.0): [0.1, 0.175]}
    rnd = random.Random(1)
    draws = [tuple(sorted((rnd.choice((0.0, 3.0)), rnd.choice((0.0, 3.0)))))
             for _ in range(6)]
    assert len(set(draws)) > 1
    for got, d in zip(vrun(pairs(1, 6), clock), draws):
        assert got == pytest.approx(ends[d], abs=EXACT), (got, d)

    async def alone() -> float:
        t0 = clock.now
        await Processor(samples=(3.0,)).run(0.1)
        return clock.now - t0

    assert vrun(alone(), clock) == pytest.approx(0.1, abs=EXACT)
    with pytest.raises(ValueError):
        Processor(samples=(0.5, -1.0))
    prof = EngineProfile.from_json({**load("vllm_cpu_bench").to_json(),
                                    "host_interference_samples": [0.0, 2.5]})
    assert prof.host_interference_samples == (0.0, 2.5)
    with pytest.raises(ValueError):
        EngineProfile.from_json({**load("vllm_cpu_bench").to_json(),
                                 "host_interference_samples": [0.0, "x"]})


def test_host_interference_is_the_mean_overlapped_slowdown_of_the_compute() -> None:
    """measure.interference_of: a trial at ratio r over an alone TTFT t with api_s a gives
    (r*t - t) / (t - a), below 0 counted as 0; the mean over overlapped trials, alone
    trials not counted."""
    def tr(case: str, ttft: float, ratio: float) -> dict[str, object]:
        return {"shape": "hot", "round": 0, "case": case, "ttft_s": ttft, "ratio": ratio}

    trials = [tr("alone", 0.2, 1.0), tr("B decodes", 0.3, 1.5), tr("B decodes", 0.4, 2.0),
              tr("A and B together", 0.18, 0.9)]
    got = interference_of(trials, api_s=0.0)
    assert got["host_interference"] == pytest.approx(0.5)  # (0.5 + 1.0 + 0) / 3
    assert got["samples"] == pytest.approx([0.5, 1.0, 0.0])
    assert got["by_case"]["B decodes, hot"]["max"] == pytest.approx(1.0)
    assert got["by_case"]["B decodes, hot"]["median"] == pytest.approx(0.75)
    assert interference_of(trials, api_s=0.1)["host_interference"] == pytest.approx(1.0)
    with pytest.raises(RuntimeError):
        interference_of([tr("alone", 0.2, 1.0)], api_s=0.0)


def test_the_profile_measures_cached_prefixes_with_short_tails_and_keeps_what_was_measured_apart(
        tmp_path: Path) -> None:
    assert prefill_shapes([128, 3072], [0.0, 0.5], [64]) == [
        (128, 0), (128, 0), (3072, 0), (3072, 1536), (192, 128), (3136, 3072)]
    old = load("vllm_cpu_bench").with_(
        shared_handoff_s=0.4, host_interference=0.3, host_interference_samples=(0.0, 0.9),
        source="measured: a; store_bandwidth_bps: b; shared_handoff_s: c; "
               "host_interference: d")
    old.save(tmp_path / "p.json")
    new = load("vllm_cpu_bench").with_(source="measured: e; store_bandwidth_bps: b")
    got = keep_measured_apart(new, tmp_path / "p.json")
    assert (got.shared_handoff_s, got.host_interference) == (0.4, 0.3)
    assert got.host_interference_samples == (0.0, 0.9) and got.step_s == new.step_s
    assert got.source == ("measured: e; store_bandwidth_bps: b; shared_handoff_s: c; "
                          "host_interference: d")
    assert keep_measured_apart(new, tmp_path / "none.json") == new
    # a second --shared run replaces its own part only, whatever came after it
    assert sourced(old.source, "shared_handoff_s", "m --shared") == (
        "measured: a; store_bandwidth_bps: b; host_interference: d; "
        "shared_handoff_s: flock /tmp/kvc-vllm.lock m --shared")


def test_the_calibration_emulates_own_cores_with_the_profiles_interference(
        tmp_path: Path) -> None:
    prof = load("vllm_cpu_bench").with_(host_interference=0.8)
    prof.save(tmp_path / "p.json")
    spec = emulator_spec("m", 64, str(tmp_path / "p.json"), 1.0, "exclusive", "own", seed=2)
    assert (spec.compute, spec.discipline, spec.host_interference) == ("shared", "fair", True)
    assert spec.seed == 2 and "--host-interference" in spec.args(tmp_path / "f.json")
    off = emulator_spec("m", 64, str(tmp_path / "p.json"), 1.0, "exclusive", "own",
                        host_interference=False)
    assert off.compute == "separate"
    shared = emulator_spec("m", 64, str(tmp_path / "p.json"), 1.0, "exclusive", "shared")
    assert (shared.compute, shared.discipline) == ("shared", "exclusive")


def test_an_exclusive_processor_serves_its_holder_then_hands_over(clock: VirtualClock
                                                                  ) -> None:
    """Engine B's step waits for A's busy period and the handoff; A, holding the
    processor, runs its next step first even though B asked before it."""
    async def run() -> dict[str, float]:
        p = ExclusiveProcessor(handoff_s=0.1)
        t0 = clock.now
        done: dict[str, float] = {}

        async def a() -> None:
            await p.run(0.1, "A")
            await p.run(0.1, "A")  # resubmitted at once: A keeps the processor
            done["A"] = clock.now - t0

        async def b() -> None:
            await asyncio.sleep(0.02)
            await p.run(0.1, "B")
            done["B"] = clock.now - t0

        await asyncio.gather(a(), b())
        return done

    done = vrun(run(), clock)
    assert done["A"] == pytest.approx(0.2, abs=EXACT)
    assert done["B"] == pytest.approx(0.4, abs=EXACT)  # 0.2 of A, 0.1 handoff, 0.1 own


def test_store_hits_come_from_the_real_store_and_cost_their_load(
        store_cfg: StoreConfig) -> None:
    with open_store(store_cfg) as st:
        hits = StoreHits(st, "bench", 16)
        a, b = EngineCore(PROF, 64, hits), EngineCore(PROF, 64, hits)
        prompt = toks(30, 200)

        def serve(core: EngineCore) -> Request:
            r = Request("r", prompt, 2)
            core.add(r)
            t = 0.0
            while not core.idle:
                s = core.plan(t)
                assert s is not None
                t += s.work_s
                core.finish(s, t)
            return r

        first = serve(a)
        assert first.cached_tokens == 0
        second = serve(b)  # another engine: the store has the prompt, tail included
        assert second.local_hit == 0 and second.external_hit == 199
        assert second.load_s == pytest.approx(PROF.load_s(199))
        assert b.counters.external_prefix_cache_hits == 199


def _gaps_beside_a_load(async_loads: bool) -> tuple[list[float], Request, Request]:
    """One request decoding while two more arrive whose KV a P/D prefill handed over (a
    load of 299 tokens each, 0.299 s at this profile's bandwidth): the decoding one's
    token gaps, and the two loaded requests."""
    prof = PROF.with_(kv_bytes_per_token=1000, store_bandwidth_bps=1e6)
    core = EngineCore(prof, 256)
    core.async_loads = async_loads
    dec = Request("d", toks(40, 100), 40)
    core.add(dec)
    loaded = [Request(f"l{i}", toks(41 + i, 300), 2, transferred=299) for i in range(2)]
    t, last, gaps = 0.0, 0.0, []
    while not core.idle:
        if dec.output == 1 and not loaded[0].arrival:  # arriving as the first token left
            for r in loaded:
                r.arrival = t
                core.add(r)
        s = core.plan(t)
        if s is None:  # only loads under way: the engine waits for the first to end
            wait = core.next_load_s(t)
            assert wait is not None
            t += wait
            continue
        t += s.work_s
        emitted = dec.output
        core.finish(s, t)
        if dec.output > emitted:
            if emitted:
                gaps.append(t - last)
            last = t
    return gaps, loaded[0], loaded[1]


def test_an_asynchronous_load_runs_beside_the_steps_and_its_request_computes_after_it(
        ) -> None:
    sync_gaps, _, _ = _gaps_beside_a_load(False)
    gaps, a, b = _gaps_beside_a_load(True)
    # inside the step, the two loads stall the decoding request's tokens; beside it, never
    assert max(sync_gaps) >= 0.299
    assert max(gaps) < 0.05
    # each loaded request computes its last prompt token only once its load is done, and
    # the engine's loads run one after another at its bandwidth
    assert a.t_admit is not None and b.t_admit == a.t_admit
    assert a.t_first is not None and a.t_first >= a.t_admit + 0.299
    assert b.t_first is not None and b.t_first >= a.t_admit + 2 * 0.299
    assert a.external_hit == b.external_hit == 299 and a.load_s == pytest.approx(0.299)


def test_a_connector_turned_off_neither_looks_up_nor_saves(store_cfg: StoreConfig) -> None:
    with open_store(store_cfg) as st:
        hits = StoreHits(st, "bench", 16)
        prompt = toks(31, 200)
        hits.enabled = False
        hits.save(prompt, None, with_tail=True)
        assert hits.puts == 0
        hits.enabled = True
        assert hits.lookup(prompt, None) == 0  # nothing was saved
        hits.save(prompt, None, with_tail=True)
        assert hits.lookup(prompt, None) == 199
        hits.enabled = False
        assert hits.lookup(prompt, None) == 0


# ------------------------------------------------------------------------------- HTTP

def two_engines(logs: Path, store: dict[str, Any] | None = None) -> EmulatedFleet:
    """Two emulated engines of 32 pages of 128 tokens (optionally over ``store``)."""
    prof = logs / "p.json"
    PROF.with_(page_size=128, max_num_batched_tokens=2048).save(prof)
    tok = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    return EmulatedFleet(EmulatorSpec(2, tok, profile=str(prof), pages=32, store=store), logs)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedFleet]:
    with two_engines(tmp_path_factory.mktemp("emu")) as f:
        yield f


def stream(url: str, prompt: list[int], max_tokens: int = 3) -> dict[str, Any]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    texts, usage = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30,
                      headers={"x-request-id": "req-1"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                obj = json.loads(line[6:])
                usage = obj.get("usage") or usage
                texts += [c["text"] for c in obj["choices"]]
    return {"texts": texts, "usage": usage}


def test_http_streams_counts_hits_and_reports_as_vllm(emulator: EmulatedFleet) -> None:
    url = emulator.urls[0]
    prompt = toks(40, 300)
    first = stream(url, prompt)
    assert len(first["texts"]) == 3 and first["usage"]["prompt_tokens"] == 300
    again = stream(url, prompt)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
    other = stream(emulator.urls[1], prompt)  # no store: the other engine misses
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    page = httpx.get(url + "/metrics").text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="bench"} 256.0' in page
    assert 'num_gpu_blocks="32"' in page and "vllm:num_requests_running" in page
    recs = httpx.get(url + "/emulator/requests").json()
    assert recs[-1]["request_id"] == "req-1" and recs[-1]["local_hit"] == 256
    # its longest gap between tokens, as the engine emitted them: one decode step
    assert 0 < recs[-1]["tbt_s"] < 5
    since = time.monotonic()
    # the loop's watcher wakes every 10 ms: wait for its first sample since then
    assert wait_until(lambda: emulator.stats(since=since)[0]["loop_lag_max_s"] is not None,
                      30)
    lag = emulator.stats(since=since)[0]
    assert 0 <= lag["loop_lag_p99_s"] <= lag["loop_lag_max_s"] < 5
    assert emulator.stats(since=time.monotonic() + 60)[0]["loop_lag_max_s"] is None
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": "bench", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 2}, timeout=30).json()
    assert r["object"] == "chat.completion" and r["usage"]["completion_tokens"] == 2
    assert httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": [1]},
                      timeout=30).status_code == 404
    assert httpx.post(url + "/reset_prefix_cache").status_code == 200
    assert stream(url, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_fleet_run_without_the_store_keeps_kv_in_each_engines_own_cache(
        tmp_path: Path, runtime_dir: Path, store_cfg: StoreConfig,
        emulator: EmulatedFleet) -> None:
    """``use_store(False)`` (Figure 5's baselines): another engine misses what one
    computed; turned back on, the store serves it again, also to an engine loading
    beside its steps. A storeless fleet refuses to turn a store on, and its engines
    answer 404."""
    with pytest.raises(ValueError, match="without a store"):
        emulator.use_store(True)
    emulator.use_store(False)  # nothing to turn off
    assert httpx.post(emulator.urls[0] + "/emulator/store", json={"enabled": False},
                      timeout=30).status_code == 404
    store = {"name": store_cfg.name, "runtime_dir": str(runtime_dir),
             "capacity_bytes": 64 << 20}  # store_cfg's store: stopped at its teardown
    launcher.ensure_running(StoreConfig.from_dict(store))
    with two_engines(tmp_path, store) as f:
        prompt = toks(43, 300)

        def cached(url: str) -> int:
            return int(stream(url, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"])

        f.use_store(False)
        assert cached(f.urls[0]) == 0
        assert cached(f.urls[1]) == 0  # engine 0 saved nothing
        f.use_store(True)
        assert cached(f.urls[0]) == 256  # its own pages; its prefill saves the prompt
        assert cached(f.urls[1]) == 299  # now from the store
        # an idle engine loading beside its steps (a P/D decode's way) waits for the load
        # to end, then computes the rest: same hit, the answer comes
        f.async_loads([False, True])
        prompt = toks(44, 300)
        assert cached(f.urls[0]) == 0 and cached(f.urls[1]) == 299
        bad = httpx.post(f.urls[0] + "/emulator/store", json={"enabled": "no"}, timeout=30)
        assert bad.status_code == 400 and "enabled" in bad.text


def test_which_engines_load_beside_their_steps_is_set_over_http(emulator: EmulatedFleet
                                                                  ) -> None:
    url = emulator.urls[0]
    for bad in ({"async": "yes"}, {"enabled": True}, [True]):
        r = httpx.post(url + "/emulator/loads", json=bad, timeout=10)
        assert r.status_code == 400 and "async" in r.json()["message"]
    with pytest.raises(ValueError, match="2 engines"):
        emulator.async_loads([True])
    emulator.async_loads([True, False])
    try:  # the engine serves as before: a request without a store hit loads nothing
        assert len(stream(url, toks(60, 40))["texts"]) == 3
    finally:
        emulator.async_loads([False, False])


def test_the_context_is_what_one_engines_cache_holds(emulator: EmulatedFleet) -> None:
    """32 pages of 128 tokens under a 32k context: vLLM would not start; the emulator
    serves a 4096-token context, and a longer request gets vLLM's 400 at once instead of
    waiting for pages that can never be free (it blocked every request behind it)."""
    url = emulator.urls[0]
    models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    assert [m["max_model_len"] for m in models] == [32 * 128]
    r = httpx.post(url + "/v1/completions", json={"model": "bench", "prompt": toks(41, 4094),
                                                  "max_tokens": 3}, timeout=30)
    assert r.status_code == 400 and "maximum context length is 4096" in r.text
    assert len(stream(url, toks(42, 4000))["texts"]) == 3  # and the queue moves on


def test_calibration_reports_when_the_other_engine_slowed_a_request() -> None:
    """calibrate.interference: a request waiting for its first token while the other
    engine had one in flight counts as overlapped; its own engine's work does not."""
    def rec(url: str, start: float, ttft: float, latency: float) -> dict[str, object]:
        return {"url": url, "start_s": start, "ttft_s": ttft, "latency_s": latency,
                "success": True}

    records = [rec("a", 0.0, 0.2, 1.0),     # alone
               rec("b", 0.5, 0.4, 0.6),     # a still decoding: overlapped, slow
               rec("a", 2.0, 0.2, 0.3),     # alone
               rec("a", 2.1, 0.25, 0.3)]    # only its own engine busy: alone
    got = interference(records)
    assert got["overlapped_share"] == 0.25
    assert got["overlapped_share_slowest_tenth"] == 1.0
    assert got["ttft_p50_ms_overlapped"] == 400.0
    assert got["ttft_p50_ms_alone"] == 200.0
    assert interference([]) == {}
