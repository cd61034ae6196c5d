"""benchmarks/serving/loadgen.py: workloads, trace synthesis, metrics, and every workload
against a real vLLM CPU server (tiny model: the session's shared plain engine)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.lib import plot
from kvcentric.bench_serving import loadgen, scrape
from kvcentric.bench_serving.client import Api, send
from kvcentric.bench_serving.metrics import RequestRecord, summarize
from kvcentric.bench_serving.runner import RunConfig
from kvcentric.bench_serving.tokens import TAG_DIGITS, TokenSource
from kvcentric.bench_serving.trace import Synthesizer, read_trace, scaled_lengths
from kvcentric.bench_serving.workloads import WorkloadSpec, build
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import VllmServer

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"
VLLM_BLOCK = 128  # the CPU backend's page size: prefix-cache hits come in these units
SUMMARY_KEYS = ("ttft_mean_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_mean_ms", "itl_p99_ms",
                "e2e_mean_ms", "request_throughput", "output_throughput",
                "total_token_throughput", "goodput", "completed", "failed", "rejected",
                "hit_tokens")


@pytest.fixture(scope="module")
def tiny_model() -> str:
    return str(build_model("tiny", Path.cwd() / ".models" / "tiny"))


@pytest.fixture(scope="module")
def src(tiny_model: str) -> TokenSource:
    return TokenSource(tiny_model)


def write_synthetic_trace(path: Path, conversations: int = 12, seed: int = 7) -> Path:
    """A Mooncake-format trace: conversations whose turns extend the previous turn's
    prompt (its partial last block replaced), all sharing block 0 (a system prompt)."""
    rnd = random.Random(seed)
    next_id, t, convs, lines = 1, 0, [], []
    for _ in range(conversations):
        convs.append([0, *range(next_id, next_id + 2)])
        next_id += 2
    for _turn in range(4):
        for c, ids in enumerate(convs):
            if rnd.random() < 0.3:
                continue
            t += rnd.randint(100, 2000)
            lines.append({"timestamp": t, "input_length": len(ids) * 512 - rnd.randint(1, 400),
                          "output_length": rnd.randint(20, 300), "hash_ids": list(ids)})
            grow = rnd.randint(1, 2)
            convs[c] = [*ids[:-1], *range(next_id, next_id + grow + 1)]
            next_id += grow + 1
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module", params=["shared", "synthetic"])
def trace_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared Mooncake conversation trace (skipped where a checkout lacks it) and a
    synthetic trace in the same format."""
    if request.param == "shared":
        if not TRACE.is_file():
            pytest.skip(f"this machine has no shared trace at {TRACE} (outside the repository)")
        return TRACE
    return write_synthetic_trace(tmp_path_factory.mktemp("trace") / "synthetic.jsonl")


# ------------------------------------------------------------------ tokens and workloads

def test_word_tokens_round_trip(src: TokenSource) -> None:
    ids = src.random_ids(random.Random(1), 3000)
    assert src.encode(src.text(ids), special=False) == ids
    assert src.encode(src.text(ids)) == src.encode("") + ids  # the server adds only BOS


def test_equal_hash_ids_give_equal_blocks_and_different_ones_differ(
        src: TokenSource) -> None:
    syn, again = Synthesizer(src, 16, seed=3), Synthesizer(src, 16, seed=3)
    blocks = [syn.block_of(h) for h in range(3000)]
    assert all(len(b) == 16 for b in blocks)
    assert len(set(blocks)) == len(blocks)  # different ids: different blocks
    assert [again.block_of(h) for h in range(3000)] == blocks  # a pure function of the id
    a, b = syn.prompt([7, 8, 9], 40), syn.prompt([7, 8, 10], 48)
    assert a[:32] == b[:32] and a[32:40] != b[32:40]
    with pytest.raises(ValueError):
        syn.prompt([1, 2], 33)


def test_trace_prompts_share_exactly_the_traces_prefixes(src: TokenSource,
                                                        trace_file: Path) -> None:
    recs = read_trace(trace_file, 300)
    syn = Synthesizer(src, 32)
    prompts = []
    for r in recs:
        n_in, _ = scaled_lengths(r, 1 / 16)
        prompts.append(syn.prompt(r.hash_ids, n_in))
        assert len(prompts[-1]) == n_in and (len(r.hash_ids) - 1) * 32 < n_in
    shared_pairs, n = 0, len(recs)
    for i in range(0, n, 7 if n > 100 else 1):
        for j in range(i + 1, n, 3 if n > 100 else 1):
            hi, hj = recs[i].hash_ids, recs[j].hash_ids
            c = next((k for k, (x, y) in enumerate(zip(hi, hj)) if x != y), min(len(hi), len(hj)))
            pi, pj = prompts[i], prompts[j]
            assert pi[:32 * c] == pj[:32 * c]
            if c < min(len(hi), len(hj)):
                assert pi[32 * c: 32 * c + TAG_DIGITS] != pj[32 * c: 32 * c + TAG_DIGITS]
            shared_pairs += c > 1
    assert shared_pairs > 0  # the trace's conversations do continue one another


def test_trace_reader_rejects_bad_lines(tmp_path: Path) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n'
                   '{"timestamp": 1, "input_length": 5}\n')
    with pytest.raises(ValueError, match="t.jsonl:2"):
        read_trace(bad)
    assert len(read_trace(bad, max_requests=1)) == 1


def test_workload_shapes(src: TokenSource) -> None:
    mt = build(WorkloadSpec(num_users=5, turns_mean=3, turns_std=1, user_context_len=40,
                            turn_input_len=8, turn_gap=0.5, user_rate=2.0, seed=4), src)
    assert len(mt.sessions) == 5 and len({s.system for s in mt.sessions}) == 1
    assert [s.start_s for s in mt.sessions] == sorted(s.start_s for s in mt.sessions)
    for s in mt.sessions:
        assert [len(t.user) for t in s.turns] == [48] + [8] * (len(s.turns) - 1)
        assert [t.gap_s for t in s.turns] == [0.0] + [0.5] * (len(s.turns) - 1)
    sp = build(WorkloadSpec(workload="shared-prefix", num_groups=3, prompts_per_group=4), src)
    assert len(sp.sessions) == 12 and len({s.system for s in sp.sessions}) == 3
    hr = build(WorkloadSpec(workload="hit-ratio", input_len=100, hit_ratio=0.3), src)
    for warm, s in zip(hr.warmup, hr.sessions):
        assert s.turns[0].user[:30] == warm.turns[0].user and len(s.turns[0].user) == 100
    for bad in ({"hit_ratio": 1.5}, {"workload": "nope"}, {"workload": "trace"},
                {"num_users": 0}, {"user_rate": -1.0}, {"scale_tokens": 2.0},
                {"max_output_len": 0}):
        with pytest.raises(ValueError):
            WorkloadSpec(**bad)


# ------------------------------------------------------------------------------ metrics

def _rec(sid: str, **kw: Any) -> RequestRecord:
    return RequestRecord(sid, 0, "u", 0.0, kw.pop("prompt_len", 10), 8, **kw)


def test_metrics_match_hand_computed_values() -> None:
    recs = [
        _rec("a", success=True, status=200, prompt_len=100, ttft_s=0.1, latency_s=0.5,
             output_tokens=5, itl_s=[0.05, 0.15, 0.1, 0.1], cached_tokens=64,
             predicted_ttft_s=0.15),
        _rec("b", success=True, status=200, prompt_len=200, ttft_s=0.3, latency_s=1.3,
             output_tokens=11, itl_s=[0.1] * 10, cached_tokens=128, predicted_ttft_s=0.3),
        _rec("c", success=True, status=200, prompt_len=50, ttft_s=0.2, latency_s=0.2,
             output_tokens=1, predicted_ttft_s=0.01, retries=1),
        _rec("d", status=500, error="HTTP 500: boom"),
        _rec("e", status=429, error="HTTP 429: busy"),
    ]
    s = summarize(recs, 2.0, slo_ttft_ms=250)
    ap = pytest.approx
    assert (s["completed"], s["failed"], s["rejected"]) == (3, 1, 1)
    assert s["failure_reasons"] == {"HTTP 500: boom": 1}
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (350, 17)
    assert s["request_throughput"] == ap(1.5) and s["output_throughput"] == ap(8.5)
    assert s["total_token_throughput"] == ap(183.5)
    # TTFT 100/300/200 ms: p90 interpolates at rank 1.8 -> 200 + 0.8 * 100
    assert s["ttft_mean_ms"] == ap(200) and s["ttft_p50_ms"] == ap(200)
    assert s["ttft_p90_ms"] == ap(280) and s["ttft_p99_ms"] == ap(298)
    # TPOT (e2e - ttft) / (out - 1): a 0.4/4 = 100 ms, b 1.0/10 = 100 ms; c has one token
    assert s["tpot_mean_ms"] == ap(100) and s["tpot_p99_ms"] == ap(100)
    # ITL pooled: 0.05, 0.1 x 12, 0.15: p99 at rank 12.87 -> 100 + 0.87 * 50
    assert s["itl_mean_ms"] == ap(100) and s["itl_p99_ms"] == ap(143.5)
    assert s["e2e_mean_ms"] == ap(2000 / 3) and s["e2e_p50_ms"] == ap(500)
    # goodput (TTFT <= 250 ms): a and c out of 5 sent, over 2 s
    assert s["good_requests"] == 2 and s["goodput"] == ap(1.0) and s["slo_attainment"] == ap(0.4)
    assert s["hit_tokens"] == 192 and s["hit_rate"] == ap(192 / 350)
    # |actual - predicted| / actual: a 0.5, b 0; c was retried (its TTFT counts the wait)
    assert s["predicted_requests"] == 2 and s["prediction_error_median"] == ap(0.25)
    both = summarize(recs, 2.0, slo_ttft_ms=250, slo_tpot_ms=50, hit_tokens=7.0)
    assert both["goodput"] == ap(0.5) and both["hit_tokens"] == 7.0  # only c: TPOT 0
    none = summarize(recs[3:], 1.0)
    assert none["goodput"] is None and none["ttft_mean_ms"] is None and none["completed"] == 0
    with pytest.raises(ValueError):
        summarize(recs, 0.0)


class _BusyThenServe(BaseHTTPRequestHandler):
    """Answers the first ``busy`` POSTs 429 (Retry-After 0.2 s), then one SSE stream."""

    busy = 0
    seen: list[float] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append(time.perf_counter())
        if len(self.seen) <= self.busy:
            body = b'{"error": {"message": "predicted TTFT exceeds the SLO", "code": 429}}'
            self.send_response(429)
            self.send_header("Retry-After", "0.2")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("x-kvc-predicted-ttft-ms", "12.5")
        self.end_headers()
        for text in ("a", "b"):
            self.wfile.write(b"data: " + json.dumps({"choices": [{"text": text}]}).encode()
                             + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize(("busy", "retries", "ok"), [(2, 2, True), (2, 1, False)])
def test_429_is_retried_after_retry_after(busy: int, retries: int, ok: bool) -> None:
    """A real HTTP server refuses ``busy`` times; the client waits Retry-After and resends
    up to ``retries`` times; TTFT counts from the first attempt."""
    handler = type("H", (_BusyThenServe,), {"busy": busy, "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    rec = RequestRecord("s", 0, "", 0.0, 3, 2)

    async def go() -> str:
        async with httpx.AsyncClient() as client:
            return await send(client, url, Api("m"), "hi", rec, time.perf_counter(), retries)

    try:
        text = asyncio.run(go())
    finally:
        server.shutdown()
        server.server_close()
    assert rec.retries == retries and len(handler.seen) == retries + 1
    assert all(b - a >= 0.2 for a, b in zip(handler.seen, handler.seen[1:]))
    if ok:
        assert rec.success and rec.status == 200 and text == "ab"
        assert rec.ttft_s >= 0.4 and rec.output_tokens == 2
        assert rec.predicted_ttft_s == pytest.approx(0.0125)
    else:
        assert not rec.success and rec.rejected and text == ""
        assert "exceeds the SLO" in rec.error
    assert summarize([rec], 1.0)["retried_429"] == retries
    with pytest.raises(ValueError, match="retry-429"):
        RunConfig(("http://x",), Api("m"), retry_429=-1)


def test_scrape_parse_and_delta() -> None:
    text = ('# HELP x\nvllm:prefix_cache_hits_total{engine="0",model_name="a b"} 256.0\n'
            'vllm:prefix_cache_hits_total{engine="1",model_name="a b"} 128.0\n'
            'vllm:external_prefix_cache_hits_total{engine="0"} 512 1700000000\n'
            'vllm:num_requests_running 3\n')
    after = scrape.parse(text)
    assert after["vllm:prefix_cache_hits_total"] == 384.0
    assert after["vllm:external_prefix_cache_hits_total"] == 512.0
    before = {"vllm:prefix_cache_hits_total": 100.0, "vllm:external_prefix_cache_hits_total": 12}
    d = scrape.delta({"s1": before, "s2": None}, {"s1": after, "s2": None})
    assert (d["hit_tokens"], d["hit_tokens_local"], d["hit_tokens_external"]) == (784, 284, 500)
    assert d["unreachable"] == ["s2"] and "vllm:num_requests_running" not in d["total"]
    assert scrape.delta({"s": {}}, {"s": {"other": 1.0}})["hit_tokens"] is None
    assert d["engine_itl_ms"] is None and d["engine_ttft_ms"] is None


def test_scrape_engine_latency_means_over_servers() -> None:
    """The engines' own ITL/TTFT means: histogram sums over counts, summed over servers."""
    page = ('vllm:inter_token_latency_seconds_bucket{le="0.1"} 9\n'
            'vllm:inter_token_latency_seconds_sum{engine="0"} {s}\n'
            'vllm:inter_token_latency_seconds_count{engine="0"} {n}\n'
            'vllm:time_to_first_token_seconds_sum{engine="0"} 2.0\n'
            'vllm:time_to_first_token_seconds_count{engine="0"} 4\n')
    before = {u: scrape.parse(page.replace("{s}", "1.0").replace("{n}", "10"))
              for u in ("a", "b")}
    after = {"a": scrape.parse(page.replace("{s}", "2.0").replace("{n}", "30")),
             "b": scrape.parse(page.replace("{s}", "4.0").replace("{n}", "40"))}
    d = scrape.delta(before, after)
    assert d["engine_itl_ms"] == pytest.approx(1000 * (1.0 + 3.0) / (20 + 30))
    assert d["engine_ttft_ms"] is None  # no new first tokens
    assert "vllm:inter_token_latency_seconds_bucket" not in d["total"]


# ---------------------------------------------------------------- against a real vLLM

@pytest.fixture(scope="module")
def server(plain_tiny: VllmServer) -> VllmServer:
    """The session's plain engine (tests/helpers/engines.py: shared, with
    ``--enable-prompt-tokens-details``), its prefix cache emptied here: the tests count
    exact hits, which blocks of other modules' prompts must not add to (this module's own
    tests use prompts of their own, or reset the cache themselves)."""
    plain_tiny.reset_prefix_cache()
    return plain_tiny


def _run(src: TokenSource, urls: list[str], spec: WorkloadSpec, endpoint: str = "completions",
         fmt: str = "text", model: str = "tiny", **kw: Any) -> dict[str, Any]:
    cfg = RunConfig(tuple(urls), Api(model, endpoint), fmt, max_concurrency=kw.pop("conc", None))
    return loadgen.benchmark(src, build(spec, src), cfg, progress=False, **kw)


def _check_records(res: dict[str, Any], output_len: int | None) -> list[dict[str, Any]]:
    """All requests completed, token-exact, with their full answers; returns them."""
    s = res["summary"]
    assert s["failed"] == 0 and s["rejected"] == 0 and s["completed"] == res["workload"]["requests"]
    for r in res["requests"]:
        assert r["success"] and r["prompt_len"] == r["server_prompt_tokens"]  # token-exact
        assert r["output_tokens"] == r["max_tokens"] == (output_len or r["max_tokens"])
        assert 0 < r["ttft_s"] <= r["latency_s"] and len(r["itl_s"]) <= r["output_tokens"] - 1
    for key in SUMMARY_KEYS:
        assert key in s
    return list(res["requests"])


@pytest.mark.vllm
def test_multi_turn_resends_history(server: VllmServer, src: TokenSource) -> None:
    spec = WorkloadSpec(num_users=3, turns_mean=3, shared_system_prompt_len=256,
                        user_context_len=128, turn_input_len=32, output_len=8, turn_gap=0.05,
                        seed=11)
    res = _run(src, [server.url], spec, slo_ttft_ms=60_000)
    recs = _check_records(res, 8)
    for user in {r["sid"] for r in recs}:
        lens = [r["prompt_len"] for r in sorted(recs, key=lambda r: r["turn"])
                if r["sid"] == user]
        assert len(lens) == 3 and lens[0] >= 1 + 256 + 128 + 32
        assert all(b >= a + 32 + 8 - 2 for a, b in zip(lens, lens[1:]))  # history + answer
    s = res["summary"]
    # turns 2 and 3 of each user reuse at least the full blocks of the previous prompt
    assert s["hit_tokens"] >= 3 * 2 * (lens[0] // VLLM_BLOCK) * VLLM_BLOCK
    assert s["hit_tokens"] == sum(r["cached_tokens"] for r in recs)
    assert s["goodput"] == pytest.approx(s["request_throughput"])


@pytest.mark.vllm
def test_multi_turn_chat_round_robin_over_two_urls(server: VllmServer,
                                                   src: TokenSource) -> None:
    other = server.url.replace("127.0.0.1", "localhost")
    spec = WorkloadSpec(num_users=2, turns_mean=2, shared_system_prompt_len=64,
                        user_context_len=64, turn_input_len=16, output_len=6, seed=12)
    res = _run(src, [server.url, other], spec, endpoint="chat",
               metrics_urls=[server.url], conc=1)
    recs = _check_records(res, 6)
    assert [r["url"] for r in recs] == [server.url, other] * 2


@pytest.mark.vllm
def test_shared_prefix_hits_the_group_prompt(server: VllmServer, src: TokenSource) -> None:
    spec = WorkloadSpec(workload="shared-prefix", num_groups=2, prompts_per_group=3,
                        shared_system_prompt_len=256, turn_input_len=32, output_len=4, seed=13)
    res = _run(src, [server.url], spec, conc=1)
    _check_records(res, 4)
    # BOS + 256 shared tokens: 2 full blocks, hit by the 2 later prompts of each group
    assert res["summary"]["hit_tokens"] == 2 * 2 * 2 * VLLM_BLOCK


@pytest.mark.vllm
def test_hit_ratio_serves_the_prefix_first(server: VllmServer, src: TokenSource) -> None:
    spec = WorkloadSpec(workload="hit-ratio", input_len=512, hit_ratio=0.5, num_prompts=3,
                        output_len=4, seed=14)
    res = _run(src, [server.url], spec, fmt="ids")
    _check_records(res, 4)
    assert res["warmup_errors"] == []
    assert res["summary"]["hit_tokens"] == 3 * 2 * VLLM_BLOCK  # BOS + 256: 2 blocks each


def expected_hits(seqs: list[list[int]], block: int = VLLM_BLOCK) -> int:
    """Prefix-cache hit tokens of sequential requests on an engine with an unbounded cache:
    each reuses the longest common prefix with an earlier prompt, up to that prompt's full
    blocks, in whole blocks, never the last token."""
    total = 0
    for i, s in enumerate(seqs):
        best = 0
        for q in seqs[:i]:
            common = next((k for k, (x, y) in enumerate(zip(s, q)) if x != y), min(len(s), len(q)))
            best = max(best, min(common, len(q) // block * block))
        total += min(best // block * block, (len(s) - 1) // block * block)
    return total


@pytest.mark.vllm
def test_trace_replay(server: VllmServer, src: TokenSource, trace_file: Path) -> None:
    # outputs capped: the hits are the claim, and the trace's own outputs (hundreds of
    # tokens after scaling) would be most of the test's time
    spec = WorkloadSpec(workload="trace", trace=str(trace_file), max_requests=14,
                        scale_tokens=0.25, max_input_len=2500, max_output_len=4,
                        time_scale=1e-4, seed=15)
    workload = build(spec, src)
    assert all(t.output_len <= 4 for s in workload.sessions for t in s.turns)
    uncapped = build(dataclasses.replace(spec, max_output_len=None), src)
    assert max(t.output_len for s in uncapped.sessions for t in s.turns) > 4
    server.reset_prefix_cache()  # the other trace's blocks (equal ids: equal tokens) go
    res = _run(src, [server.url], spec, fmt="ids", conc=1)
    recs = _check_records(res, None)
    assert len(recs) == 14 - res["workload"]["skipped_too_long"] >= 5
    prompts = {s.sid: s.turns[0].user for s in workload.sessions}
    seqs = [src.encode("") + list(prompts[r["sid"]]) for r in recs]  # in the order served
    want = expected_hits(seqs)
    assert want >= (len(recs) - 1) * VLLM_BLOCK  # block 0 is shared by all, at least
    assert res["summary"]["hit_tokens"] == want


@pytest.mark.vllm
def test_failures_are_counted_with_reasons(server: VllmServer, src: TokenSource) -> None:
    spec = WorkloadSpec(num_users=2, turns_mean=3, shared_system_prompt_len=0,
                        user_context_len=16, turn_input_len=8, output_len=2, seed=16)
    res = _run(src, [server.url], spec, model="no-such-model")
    s = res["summary"]
    assert (s["completed"], s["failed"], s["aborted_turns"]) == (0, 2, 4)
    (reason,) = s["failure_reasons"]
    assert reason.startswith("HTTP 404") and "no-such-model" in reason


@pytest.mark.vllm
def test_cli_writes_result_json(server: VllmServer, tiny_model: str, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    rc = loadgen.main(["--base-url", server.url, "--tokenizer", tiny_model,
                             "--workload", "shared-prefix", "--num-groups", "1",
                             "--prompts-per-group", "2", "--shared-system-prompt-len", "64",
                             "--turn-input-len", "8", "--output-len", "3", "--request-rate",
                             "50", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
                             "--out", str(out), "--disable-tqdm"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["api"]["model"] == "tiny"  # found through /v1/models
    assert doc["config"]["workload"]["request_rate"] == 50
    assert len(doc["requests"]) == 2 and doc["summary"]["goodput"] > 0
    assert all(k in doc["summary"] for k in SUMMARY_KEYS)
    assert "Serving Benchmark Result" in capsys.readouterr().out
    assert plot.main([str(out), str(out), "--out", str(tmp_path / "cmp")]) == 0
    for suffix in ("_ttft_cdf.png", "_throughput.png"):
        assert (tmp_path / f"cmp{suffix}").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        loadgen.main(["--tokenizer", tiny_model, "--model", "tiny", "--hit-ratio", "2"])


def test_compare_helpers() -> None:
    from benchmarks.serving import report

    reqs = [{"sid": "a", "turn": t, "url": u} for t, u in enumerate("xxyx")]
    reqs += [{"sid": "b", "turn": 1, "url": "y"}, {"sid": "b", "turn": 0, "url": "y"}]
    assert report.same_instance_rate(reqs) == pytest.approx(2 / 4)  # a: xx, xy, yx; b: yy

    def doc(label: str, ttft: float, good: float | None, rps: float) -> dict[str, Any]:
        s = {"ttft_mean_ms": ttft, "ttft_p90_ms": 2 * ttft, "goodput": good,
             "request_throughput": rps, "output_throughput": 10 * rps}
        return {"label": label, "summary": s}

    r = report.ratios(doc("base", 400, 0.5, 1.0), doc("ours", 100, 1.5, 2.0))
    assert r == {"ttft_mean_speedup": 4.0, "ttft_p90_speedup": 4.0, "goodput_ratio": 3.0,
                 "request_throughput_ratio": 2.0, "output_throughput_ratio": 2.0}
    assert report.ratios(doc("b", 1, 0.0, 1), doc("o", 1, 1.0, 1))["goodput_ratio"] is None


def test_trace_sampling_keeps_whole_conversations(src: TokenSource, trace_file: Path) -> None:
    from kvcentric.bench_serving.trace import sampled, session_key

    recs = read_trace(trace_file, 2000)
    kept = {session_key(r) for r in recs if sampled(r, 0.5, seed=5)}
    assert all(sampled(r, 0.5, 5) == (session_key(r) in kept) for r in recs)
    share = sum(session_key(r) in kept for r in recs) / len(recs)
    assert 0.1 < share < 0.9 and kept != {session_key(r) for r in recs if sampled(r, 0.5, 6)}
    wl = build(WorkloadSpec(workload="trace", trace=str(trace_file), max_requests=2000,
                            sample_sessions=0.5, scale_tokens=1 / 16, seed=5), src)
    assert wl.info["sampled"] == len(wl.sessions) == sum(session_key(r) in kept for r in recs)


def test_each_instance_gets_cores_of_its_own() -> None:
    """``--cores separate``: instance i's worker is bound to its own share of the
    machine's cores, none shared, the lowest kept for the host side (vLLM's automatic
    binding would give every instance the same); too few cores for that gives None. The
    assignment is a function of the core set, checked on sets of several sizes whatever
    this machine has, then on this machine's own."""
    import os

    from benchmarks.serving.fleet import FleetSpec, own_cores_env

    def cores(envs: tuple[dict[str, str], ...]) -> list[list[int]]:
        return [[int(c) for c in e["VLLM_CPU_OMP_THREADS_BIND"].split(",")] for e in envs]

    assert own_cores_env(2, {0, 1}) is None  # a core each and one for the rest: 3 at least
    assert own_cores_env(1, {5}) is None
    assert cores(own_cores_env(2, {0, 1, 2}) or ()) == [[1], [2]]
    assert cores(own_cores_env(1, {3, 4}) or ()) == [[4]]
    assert cores(own_cores_env(2, range(8)) or ()) == [[1, 2, 3], [4, 5, 6]]
    assert cores(own_cores_env(3, [11, 2, 7, 5, 9, 3, 13]) or ()) == [[3, 5], [7, 9],
                                                                        [11, 13]]
    for n, cpus in ((2, range(3)), (2, range(64)), (4, range(17)), (3, [8, 1, 30, 4, 2])):
        envs = own_cores_env(n, cpus)
        assert envs is not None and len(envs) == n, (n, cpus)
        got = cores(envs)
        flat = [c for cs in got for c in cs]
        assert all(got) and len(flat) == len(set(flat)), got  # each its own, none shared
        assert min(cpus) not in flat and set(flat) <= set(cpus), got  # the host keeps one
        assert len({len(cs) for cs in got}) == 1, got  # equal shares
    with pytest.raises(ValueError, match="instances"):
        own_cores_env(0, range(4))
    mine = os.sched_getaffinity(0)
    assert own_cores_env(2) == own_cores_env(2, mine)  # the default: this machine's
    envs = own_cores_env(2, range(4)) or ()
    spec = FleetSpec("m", env={"A": "1"}, instance_env=envs)
    assert spec.env_of(1) == {"A": "1", **envs[1]}
    assert FleetSpec("m", env={"A": "1"}).env_of(1) == {"A": "1"}
