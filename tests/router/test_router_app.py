"""The router app in process (httpx.ASGITransport): the OpenAI front, instance admin,
P/D flow, retries and 429s. Upstream engines are httpx.MockTransport handlers here: these
tests are about the router's own HTTP behaviour (bodies, streams, errors, which instance
gets what), where a real engine adds nothing; tests/e2e/test_router_e2e.py runs real vLLM."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from kvcentric.router.api import app as app_mod
from kvcentric.router.api.app import build_app
from kvcentric.router.config import HealthConfig, RouterConfig
from kvcentric.router.cost.cost_model import Profile
from kvcentric.router.fleet import instances as inst_mod
from kvcentric.router.fleet.instance_spec import InstanceSpec
from kvcentric.router.fleet.prefix_index import PrefixIndex
from kvcentric.router.tokenize import PromptTokenizer

PROFILE = Profile(a=0.0, b=1e-5, c=0.001, tbt_base_s=0.01, tbt_per_seq_s=0.0)
METRICS = ('vllm:num_requests_running{engine="0"} 3.0\n'
           'vllm:num_requests_waiting{engine="0"} 0.0\n'
           'vllm:kv_cache_usage_perc{engine="0"} 0.1\n'
           'vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="2048"} 1.0\n')


@dataclass
class Upstreams:
    """Fake engines keyed by host; ``fail`` maps host -> exception or status to answer."""

    calls: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    fail: dict[str, Any] = field(default_factory=dict)
    delay_s: float = 0.0

    def completion(self, host: str, body: dict[str, Any]) -> dict[str, Any]:
        return {"id": f"cmpl-{host}", "object": "text_completion", "model": body.get("model"),
                "choices": [{"index": 0, "text": f" from {host}", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9,
                          "prompt_tokens_details": {"cached_tokens": 0}}}

    async def handler(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/metrics":
            return httpx.Response(200, text=METRICS)
        body = json.loads(request.content)
        self.calls.append((host, path, body))
        await asyncio.sleep(self.delay_s)
        failure = self.fail.get(host)
        if isinstance(failure, Exception):
            raise failure
        if isinstance(failure, int):
            return httpx.Response(failure, json={"error": {"message": "boom"}})
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  content=self._sse(host))
        return httpx.Response(200, json=self.completion(host, body))

    async def _sse(self, host: str) -> AsyncIterator[bytes]:
        for i in range(3):
            yield f'data: {{"id":"s","choices":[{{"text":"t{i}-{host}"}}]}}\n\n'.encode()
            await asyncio.sleep(0)
        yield b"data: [DONE]\n\n"


def make_cfg(tiny_dir: str, instances: list[dict[str, str]], **over: Any) -> RouterConfig:
    raw: dict[str, Any] = {"model": "tiny", "tokenizer": tiny_dir, "instances": instances,
                           "slo": {"ttft_ms": 5000, "tbt_ms": 100},
                           "health": {"interval_s": 30}, "keys": {"block_size": 256}}
    raw.update(over)
    return RouterConfig.from_dict(raw)


def run(cfg: RouterConfig, tok: PromptTokenizer, ups: Upstreams,
        fn: Callable[[httpx.AsyncClient], Any], profile: Profile = PROFILE) -> Any:
    app = build_app(cfg, transport=httpx.MockTransport(ups.handler), tokenizer=tok,
                    profile=profile)

    async def go() -> Any:
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://router") as client:
                return await fn(client)

    return asyncio.run(go())


TWO = [{"url": "http://a:1", "name": "a"}, {"url": "http://b:1", "name": "b"}]


def test_completion_passes_through_unchanged(tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    ups = Upstreams()

    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "hello world",
                                                  "max_tokens": 2})
        assert r.status_code == 200
        host = r.headers["x-kvc-prefill"]
        assert r.json() == ups.completion(host, {"model": "tiny"})  # usage included
        assert r.headers["x-kvc-decode"] == host
        assert ups.calls[0][2] == {"model": "tiny", "prompt": "hello world", "max_tokens": 2}

    run(make_cfg(tiny_dir, TWO), tokenizer, ups, fn)


def test_streams_sse_through(tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    ups = Upstreams()

    async def fn(c: httpx.AsyncClient) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "stream": True}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            data = b"".join([chunk async for chunk in r.aiter_raw()])
        host = r.headers["x-kvc-decode"]
        assert data == b"".join(f'data: {{"id":"s","choices":[{{"text":"t{i}-{host}"}}]}}\n\n'
                                .encode() for i in range(3)) + b"data: [DONE]\n\n"
        m = (await c.get("/metrics")).text
        assert "kvc_router_ttft_actual_seconds_count 1.0" in m

    run(make_cfg(tiny_dir, TWO), tokenizer, ups, fn)


@pytest.mark.parametrize("path, content, status, msg", [
    ("/v1/completions", b"{not json", 400, "valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", b'{"model": "tiny"}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": [1, -2]}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "cache_salt": 3}', 400, "salt"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"content": "x"}]}', 400,
     "role"),
    ("/v1/completions", b'{"model": "gpt-9", "prompt": "x"}', 404, "does not exist"),
])
def test_bad_requests_get_clear_errors(tiny_dir: str, tokenizer: PromptTokenizer, path: str,
                                       content: bytes, status: int, msg: str) -> None:
    ups = Upstreams()

    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post(path, content=content, headers={"content-type": "application/json"})
        assert r.status_code == status
        assert msg in r.json()["error"]["message"]
        assert ups.calls == []

    run(make_cfg(tiny_dir, TWO), tokenizer, ups, fn)


def test_models_health_metrics_and_instances_admin(tiny_dir: str,
                                                   tokenizer: PromptTokenizer) -> None:
    ups = Upstreams()

    async def fn(c: httpx.AsyncClient) -> None:
        assert (await c.get("/v1/models")).json()["data"][0]["id"] == "tiny"
        assert (await c.get("/health")).json()["status"] == "ok"
        r = await c.post("/instances", json={"url": "http://c:1", "role": "decode"})
        assert r.status_code == 201 and r.json()["name"] == "c:1"
        assert (await c.post("/instances", json={"url": "http://c:1"})).status_code == 409
        assert (await c.post("/instances", json={"url": "nope"})).status_code == 400
        assert (await c.post("/instances", content=b"{")).status_code == 400
        names = [i["name"] for i in (await c.get("/instances")).json()["instances"]]
        assert names == ["a", "b", "c:1"]
        for n in ("a", "b"):
            assert (await c.delete(f"/instances/{n}")).status_code == 200
        assert (await c.delete("/instances/a")).status_code == 404
        assert (await c.get("/health")).status_code == 503  # only a decoder left
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 503 and "Retry-After" in r.headers
        m = (await c.get("/metrics")).text
        assert 'kvc_router_rejections_total{reason="no_instance"} 1.0' in m
        assert 'kvc_router_instance_healthy{instance="c:1",role="decode"} 1.0' in m

    run(make_cfg(tiny_dir, TWO), tokenizer, ups, fn)


def test_a_port_still_closing_is_waited_for_and_a_taken_one_refused(
        tiny_dir: str, tokenizer: PromptTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-adding an instance whose event port is still bound (ZMQ closes a removed
    instance's socket a moment later) succeeds once the port frees; a port that stays
    taken is refused with 409 after ``REBIND_WAIT_S``."""
    monkeypatch.setattr(app_mod, "REBIND_WAIT_S", 1.0)
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    spec = {"url": "http://c:1", "name": "c", "kv_events": f"tcp://127.0.0.1:{port}"}

    async def fn(c: httpx.AsyncClient) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        r = await c.post("/instances", json=spec)
        assert r.status_code == 409 and "cannot listen" in r.json()["error"]["message"]
        assert loop.time() - t0 >= 1.0
        assert "c" not in [i["name"] for i in (await c.get("/instances")).json()["instances"]]
        loop.call_later(0.3, held.close)
        t0 = loop.time()
        assert (await c.post("/instances", json=spec)).status_code == 201
        assert 0.25 <= loop.time() - t0 < 1.0
        for _ in range(20):  # the delete/re-add cycle the e2e tests make
            assert (await c.delete("/instances/c")).status_code == 200
            assert (await c.post("/instances", json=spec)).status_code == 201

    try:
        run(make_cfg(tiny_dir, TWO), tokenizer, Upstreams(), fn)
    finally:
        held.close()


def test_prefill_then_decode_flow(tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    ups = Upstreams()
    insts = [{"url": "http://p:1", "role": "prefill"}, {"url": "http://d:1", "role": "decode"}]

    async def fn(c: httpx.AsyncClient) -> None:
        body = {"model": "tiny", "prompt": "a b c", "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True}, "min_tokens": 2}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            text = (await r.aread()).decode()
        assert "t2-d" in text and text.endswith("data: [DONE]\n\n")
        assert [(h, b) for h, _, b in ups.calls] == [
            ("p", {"model": "tiny", "prompt": "a b c", "max_tokens": 1, "stream": False}),
            ("d", body)]
        m = (await c.get("/metrics")).text
        assert 'kvc_router_decisions_total{decode="d:1",prefill="p:1"} 1.0' in m
        assert "kvc_router_prefill_seconds_count 1.0" in m

    run(make_cfg(tiny_dir, insts), tokenizer, ups, fn)


def test_chat_prefill_body_limits_completion_tokens(tiny_dir: str,
                                                    tokenizer: PromptTokenizer) -> None:
    ups = Upstreams()
    insts = [{"url": "http://p:1", "role": "prefill"}, {"url": "http://d:1", "role": "decode"}]

    async def fn(c: httpx.AsyncClient) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hey"}],
                "max_completion_tokens": 9}
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
        pre = ups.calls[0][2]
        assert pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1
        assert ups.calls[1][2] == body

    run(make_cfg(tiny_dir, insts), tokenizer, ups, fn)


def test_long_prompts_and_long_chats_pass_the_schema(tiny_dir: str,
                                                     tokenizer: PromptTokenizer) -> None:
    """Text is bounded by the body size, never by a guess of its tokens: a 12k-character
    system prompt and a 60-message chat reach the engine (the schema once allowed 1984
    characters per message and 16 messages: every long-context chat got a 400); top_k -1
    (vLLM: disabled) is accepted. The token limit applies after tokenizing."""
    ups = Upstreams()
    system = "You are a careful assistant. " * 430  # ~12.5k characters
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
             for i in range(59)]

    async def fn(c: httpx.AsyncClient) -> None:
        body = {"model": "tiny", "max_tokens": 2, "top_k": -1,
                "messages": [{"role": "system", "content": system}, *turns]}
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert ups.calls[-1][2]["messages"][0]["content"] == system
        r = await c.post("/v1/completions", json={"model": "tiny", "max_tokens": 2,
                                                  "prompt": system})
        assert r.status_code == 200, r.text

    run(make_cfg(tiny_dir, TWO), tokenizer, ups, fn)


def test_failed_instance_is_retried_elsewhere_and_taken_out(
        tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    ups = Upstreams(fail={"a": httpx.ConnectError("refused")})

    async def fn(c: httpx.AsyncClient) -> None:
        for _ in range(3):
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x y"})
            assert r.status_code == 200 and r.headers["x-kvc-decode"] == "b"
        assert [h for h, _, _ in ups.calls] == ["a", "b", "b", "b"]  # a tried once only
        inst = {i["name"]: i for i in (await c.get("/instances")).json()["instances"]}
        assert inst["a"]["healthy"] is False and inst["b"]["decodes"] == 0
        m = (await c.get("/metrics")).text
        assert 'kvc_router_retries_total{stage="prefill"} 1.0' in m
        assert 'kvc_router_upstream_errors_total{instance="a"} 1.0' in m

    run(make_cfg(tiny_dir, TWO), tokenizer, ups, fn)


def test_decode_failure_retries_decode_once_without_double_output(
        tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    ups = Upstreams(fail={"d1": 503})
    insts = [{"url": "http://p:1", "role": "prefill"}, {"url": "http://d1:1", "role": "decode"},
             {"url": "http://d2:1", "role": "decode"}]

    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "q", "stream": True})
        assert r.status_code == 200 and r.headers["x-kvc-decode"] == "d2:1"
        assert r.text.count("data: [DONE]") == 1
        hosts = [h for h, _, _ in ups.calls]
        assert hosts.count("d1") == 1 and hosts.count("d2") == 1

    run(make_cfg(tiny_dir, insts), tokenizer, ups, fn)


def test_all_instances_failing_is_a_502_not_a_hang(tiny_dir: str,
                                                   tokenizer: PromptTokenizer) -> None:
    ups = Upstreams(fail={"a": 500, "b": httpx.RemoteProtocolError("reset")})

    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 502 and "upstream failed" in r.json()["error"]["message"]
        assert len(ups.calls) == 2  # one try and one retry

    run(make_cfg(tiny_dir, TWO), tokenizer, ups, fn)


def test_a_read_timeout_is_a_504_without_retry(tiny_dir: str,
                                               tokenizer: PromptTokenizer) -> None:
    """The engine may still be decoding: retrying elsewhere could decode twice."""
    ups = Upstreams(fail={"a": httpx.ReadTimeout("slow"), "b": httpx.ReadTimeout("slow")})

    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 504 and len(ups.calls) == 1
        inst = (await c.get("/instances")).json()["instances"]
        assert all(i["healthy"] and i["decodes"] == 0 for i in inst)

    run(make_cfg(tiny_dir, TWO), tokenizer, ups, fn)


def test_client_errors_from_the_engine_pass_through(tiny_dir: str,
                                                    tokenizer: PromptTokenizer) -> None:
    ups = Upstreams(fail={"a": 400, "b": 400})

    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 400 and r.json() == {"error": {"message": "boom"}}
        assert len(ups.calls) == 1

    run(make_cfg(tiny_dir, TWO), tokenizer, ups, fn)


def test_slo_overload_is_429_with_retry_after(tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    ups = Upstreams(delay_s=0.5)  # engine busy: requests stay in flight
    slow = Profile(a=0.0, b=2e-3, c=0.0, tbt_base_s=0.01, tbt_per_seq_s=0.0)  # 2 ms / token
    prompt = list(range(10, 510))  # ~1 s of predicted prefill each

    async def fn(c: httpx.AsyncClient) -> None:
        # fire enough at once that the predicted queue passes the 3 s SLO
        rs = await asyncio.gather(*(c.post("/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 1}) for _ in range(10)))
        codes = sorted(r.status_code for r in rs)
        assert codes.count(429) >= 2 and set(codes) == {200, 429}
        rej = next(r for r in rs if r.status_code == 429)
        assert int(rej.headers["Retry-After"]) >= 1
        assert "TTFT" in rej.json()["error"]["message"]

    run(make_cfg(tiny_dir, [TWO[0]], slo={"ttft_ms": 3000, "tbt_ms": 100}), tokenizer, ups,
        fn, profile=slow)


def test_multi_turn_follows_its_prefix_by_bookkeeping(tiny_dir: str,
                                                      tokenizer: PromptTokenizer) -> None:
    ups = Upstreams()
    turn1 = list(range(100, 100 + 600))

    async def fn(c: httpx.AsyncClient) -> list[str]:
        where = []
        for k in range(4):
            prompt = turn1 + list(range(2000, 2000 + 300 * k))
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": prompt})
            where.append(r.headers["x-kvc-prefill"])
            prev_blocks = (600 + 300 * (k - 1)) // 256 if k else 0
            assert int(r.headers["x-kvc-hit-tokens"]) == prev_blocks * 256
        return where

    where = run(make_cfg(tiny_dir, TWO), tokenizer, ups, fn)
    assert len(set(where)) == 1


def test_store_hits_count_for_every_instance(tiny_dir: str, tokenizer: PromptTokenizer,
                                             store_cfg: Any) -> None:
    """A prefix some engine stored (a real local store) makes every instance a near hit;
    the layout signature is discovered from the stored keys."""
    import numpy as np

    from kvcentric.hashing import KeySpace, block_hashes, hash_seed
    from kvcentric.store import open_store

    prompt = list(range(300, 300 + 1000))
    hashes = block_hashes(prompt, 256, hash_seed("tiny"))
    with open_store(store_cfg) as st:
        buf = np.zeros(64, np.uint8)
        keys = KeySpace("tiny", "00000000000000aa").keys(hashes)
        assert st.batch_put_from(keys, [buf.ctypes.data] * 3, [64] * 3) == [0, 0, 0]
    ups = Upstreams()
    store = {"name": store_cfg.name, "runtime_dir": str(store_cfg.local.runtime_dir)}

    async def fn(c: httpx.AsyncClient) -> list[str]:
        got = []
        for _ in range(2):
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": prompt})
            assert r.status_code == 200 and r.headers["x-kvc-hit-tokens"] == "768"
            got.append(r.headers["x-kvc-prefill"])
        info = (await c.get("/instances")).json()
        assert info["keys"]["layout_sig"] == "00000000000000aa"  # discovered
        assert info["store"]["queries"] == 1  # the second request was answered by the cache
        return got

    run(make_cfg(tiny_dir, TWO, store=store), tokenizer, ups, fn)


def test_block_size_and_cache_size_come_from_the_engines(tiny_dir: str,
                                                         tokenizer: PromptTokenizer) -> None:
    """Without keys.block_size the router uses the connector's default for the page size
    the engines report (128-token pages on vLLM CPU -> 128-token blocks)."""
    from kvcentric.connector.vllm.settings import ConnectorSettings

    ups = Upstreams()
    cfg = RouterConfig.from_dict({"model": "tiny", "tokenizer": tiny_dir, "instances": TWO,
                                  "health": {"interval_s": 0.05}})

    async def fn(c: httpx.AsyncClient) -> dict[str, Any]:
        for _ in range(100):
            info = (await c.get("/instances")).json()
            if info["keys"]["block_size"]:
                break
            await asyncio.sleep(0.02)
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": list(range(
            10, 400))})
        assert r.headers["x-kvc-hit-tokens"] == "0"
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": list(range(
            10, 500))})
        assert r.headers["x-kvc-hit-tokens"] == "384"  # 3 blocks of 128
        assert 0 <= float(r.headers["x-kvc-router-ms"]) < 10_000  # its own time, as a number
        return dict(info)

    info = run(cfg, tokenizer, ups, fn)
    assert info["keys"]["block_size"] == ConnectorSettings().stored_block_size(128) == 128
    a = next(i for i in info["instances"] if i["name"] == "a")
    assert a["cache_blocks"] == 2048 and a["running"] == 3.0


def test_metrics_are_polled_less_often_than_health(tiny_dir: str,
                                                   tokenizer: PromptTokenizer) -> None:
    """``/health`` every ``interval_s``; ``/metrics`` once at start, then only every
    ``metrics_interval_s``, and again at once when an instance comes back into rotation."""
    ups = Upstreams()
    seen: list[tuple[str, str]] = []
    down: set[str] = set()

    async def handler(request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        seen.append((host, path))
        if path == "/health" and host in down:
            return httpx.Response(503)
        return await ups.handler(request)

    cfg = make_cfg(tiny_dir, TWO, health={"interval_s": 0.02, "metrics_interval_s": 30,
                                          "unhealthy_after": 1})
    app = build_app(cfg, transport=httpx.MockTransport(handler), tokenizer=tokenizer,
                    profile=PROFILE)

    async def until(host: str, path: str, n: int) -> None:
        for _ in range(1000):
            if seen.count((host, path)) >= n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{host}{path} polled {seen.count((host, path))} times, not {n}")

    async def go() -> None:
        async with app.router.lifespan_context(app):
            await until("a", "/health", 10)
            assert seen.count(("a", "/metrics")) == 1 == seen.count(("b", "/metrics"))
            down.add("a")  # out of rotation after one failed check
            await until("a", "/health", seen.count(("a", "/health")) + 3)
            down.clear()
            await until("a", "/metrics", 2)  # back: its gauges read at once
            await until("a", "/health", seen.count(("a", "/health")) + 5)
            assert seen.count(("a", "/metrics")) == 2 and seen.count(("b", "/metrics")) == 1

    asyncio.run(go())


@dataclass
class SglangPair(Upstreams):
    """SGLang servers as the disaggregation protocol has them: ``/server_info`` names a
    prefill server's bootstrap port; a decode answers only once the prefill of its room
    answered (it waits for that KV: forever here, so a router that waits for a decode whose
    prefill failed hangs the test)."""

    rooms: dict[int, asyncio.Event] = field(default_factory=dict)
    abandoned: list[int] = field(default_factory=list)  # rooms of decodes cancelled

    def room(self, n: int) -> asyncio.Event:
        return self.rooms.setdefault(n, asyncio.Event())

    async def handler(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/server_info":
            port = 9000 + int(host[1:]) if host.startswith("p") else None
            return httpx.Response(200, json={"page_size": 16,
                                             "disaggregation_bootstrap_port": port})
        if request.url.path in ("/health", "/metrics"):
            return await super().handler(request)
        body = json.loads(request.content)
        if host.startswith("d"):
            self.calls.append((host, request.url.path, body))
            try:
                await self.room(body["bootstrap_room"]).wait()
            except asyncio.CancelledError:
                self.abandoned.append(body["bootstrap_room"])
                raise
            if body.get("stream"):
                return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                      content=self._sse(host))
            return httpx.Response(200, json=self.completion(host, body))
        r = await super().handler(request)
        if r.status_code == 200:
            self.room(body["bootstrap_room"]).set()
        return r


def test_an_sglang_pair_whose_prefill_fails_is_retried_with_another_room(
        tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    ups = SglangPair(fail={"p1": 503})
    insts = [{"url": f"http://{h}:1", "name": h, "kind": "sglang",
              "role": "prefill" if h[0] == "p" else "decode"} for h in ("p1", "p2", "d1")]

    async def fn(c: httpx.AsyncClient) -> None:
        for stream in (False, True):
            ups.calls.clear()
            r = await asyncio.wait_for(c.post("/v1/completions", json={
                "model": "tiny", "prompt": "a b c", "max_tokens": 3, "stream": stream}), 30)
            assert r.status_code == 200, r.text
            assert (r.headers["x-kvc-prefill"], r.headers["x-kvc-decode"]) == ("p2", "d1")
            calls = [(h, b) for h, _, b in ups.calls]
            # p1 failed once (then out of rotation): its decode was abandoned, not awaited
            pairs = {b["bootstrap_room"]: [] for _, b in calls}
            for h, b in calls:
                pairs[b["bootstrap_room"]].append(h)
            assert sorted(map(sorted, pairs.values())) == (
                [["d1", "p1"], ["d1", "p2"]] if not stream else [["d1", "p2"]])
            for h, b in calls:
                port = {"p1": 9001, "p2": 9002}[next(x for x in pairs[b["bootstrap_room"]]
                                                   if x[0] == "p")]
                assert (b["bootstrap_host"], b["bootstrap_port"]) == (
                    next(x for x in pairs[b["bootstrap_room"]] if x[0] == "p"), port)
                assert b["max_tokens"] == (1 if h[0] == "p" else 3)
        assert len(ups.abandoned) == 1
        inst = {i["name"]: i for i in (await c.get("/instances")).json()["instances"]}
        assert inst["d1"]["decodes"] == 0 and inst["p2"]["queued_prefills"] == 0
        assert inst["p1"]["bootstrap_port"] == 9001 and inst["d1"]["bootstrap_port"] is None

    run(make_cfg(tiny_dir, insts, health={"interval_s": 30, "unhealthy_after": 1}),
        tokenizer, ups, fn)


def counter(metrics: str, name: str) -> float:
    """The value of the unlabelled counter ``name`` (its ``_total`` sample)."""
    line = next(x for x in metrics.splitlines() if x.startswith(f"{name}_total "))
    return float(line.split()[1])


def test_metrics_count_prompt_tokens_tokenised_and_reused(tiny_dir: str) -> None:
    """``kvc_router_tokenized_tokens`` counts what the router's tokenizer produced and
    ``kvc_router_reused_prompt_tokens`` what the prompt token cache gave instead: a long
    new prompt's scan tokenises a first piece (held nowhere: it stops there), as one of
    the cache's first results the whole prompt as a check, and after the dispatch the
    rest (hashed where it went); the same system prompt with another question reuses
    what the cache holds (and is checked whole too). Each count is read once the
    request's background hashing has ended."""
    tok = PromptTokenizer(tiny_dir, cache_chars=1 << 20)
    assert tok.prefix is not None and tok.tokenized_tokens == 0  # the probes not counted
    ups = Upstreams()
    system = " ".join(f"word{i % 97} of the system prompt" for i in range(400))

    async def fn(c: httpx.AsyncClient) -> list[tuple[float, float]]:
        seen = []
        state = c._transport.app.state.router  # type: ignore[attr-defined]
        for question in ("What is the first word?", "And what is the last one?"):
            r = await c.post("/v1/completions", json={"model": "tiny", "max_tokens": 2,
                                                      "prompt": system + " " + question})
            assert r.status_code == 200
            await asyncio.gather(*state.proxy._beyond)
            m = (await c.get("/metrics")).text
            seen.append((counter(m, "kvc_router_tokenized_tokens"),
                         counter(m, "kvc_router_reused_prompt_tokens")))
        return seen

    (tok1, reused1), (tok2, reused2) = run(make_cfg(tiny_dir, TWO), tok, ups, fn)
    assert (tok2, reused2) == (tok.tokenized_tokens, tok.reused_tokens)
    ref = PromptTokenizer(tiny_dir)  # counts of its own
    whole = len(ref.encode(system + " What is the first word?"))
    # new: tokenised (and checked) whole; its rest reused only its own first piece
    assert tok1 >= whole and reused1 < whole / 2
    # the first piece reused; past it a piece and, still among the first results, a check
    assert reused2 >= len(ref.encode(system[:1024], False))
    assert tok2 - tok1 >= whole


def test_an_instance_that_just_answered_is_not_asked_for_health() -> None:
    """``health.passive``: a routed answer that started within ``interval_s`` is the
    check until the metrics poll is due; older, after a failure, after a stream broke,
    with the metrics poll due, or with passive off, the check asks ``/health``."""
    asked: list[str] = []
    draining: list[bool] = [False]

    class Client:
        async def get(self, url: str, **kw: Any) -> httpx.Response:
            asked.append(url.rsplit("/", 1)[1])
            if url.endswith("/health") and draining[0]:
                return httpx.Response(503)
            return httpx.Response(200, text=METRICS if url.endswith("/metrics") else "")

    reg = inst_mod.Registry(PrefixIndex(), 64)
    inst = reg.add(InstanceSpec.from_dict({"url": "http://a:1", "name": "a"}))
    inst.max_model_len = 4096  # no /v1/models read
    hc = HealthConfig(interval_s=30.0, metrics_interval_s=3600.0)

    def check(h: HealthConfig = hc) -> list[str]:
        asked.clear()
        asyncio.run(inst_mod.check(inst, reg, Client(), h))  # type: ignore[arg-type]
        return list(asked)

    assert check() == ["health", "metrics"]  # never answered: asked, gauges read at once
    assert inst.healthy
    reg.answered(inst)
    assert check() == []  # just answered: no poll; metrics not due
    assert check(HealthConfig(interval_s=30.0, metrics_interval_s=3600.0,
                              passive=False)) == ["health"]
    inst.metrics_at = float("-inf")
    # with the metrics poll due, /health is asked too: an engine that answers while it
    # reports itself unhealthy (draining) is still seen
    assert check() == ["health", "metrics"]
    inst.answered_at -= 31.0
    assert check() == ["health"]  # answered longer ago than the interval
    reg.answered(inst)
    reg.mark_failed(inst, 2, "HTTP 500")
    assert inst.healthy and inst.failures == 1
    assert check() == ["health"] and inst.failures == 0  # a failure: ask
    reg.answered(inst)
    reg.answered(inst, ok=False)  # a stream from it broke
    assert check() == ["health"]
    # draining: it keeps answering, its /health fails; seen at the next metrics poll
    draining[0] = True
    reg.answered(inst)
    assert check() == [] and inst.healthy
    inst.metrics_at = float("-inf")
    assert check() == ["health"] and inst.failures == 1
    reg.answered(inst)
    assert check() == ["health"] and not inst.healthy  # a failure counted: asked again


def test_the_proxy_records_answers_and_broken_streams(tiny_dir: str,
                                                      tokenizer: PromptTokenizer) -> None:
    """What the passive check rests on: a whole answer and a stream's first bytes mark
    the instance answered; a stream that breaks after them clears it."""

    class Breaking(Upstreams):
        async def _sse(self, host: str) -> AsyncIterator[bytes]:
            yield b'data: {"id":"s","choices":[{"text":"t0"}]}\n\n'
            if self.fail.get("break"):
                raise httpx.ReadError("engine gone")
            yield b"data: [DONE]\n\n"

    ups = Breaking()
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 2}

    async def fn(c: httpx.AsyncClient) -> None:
        reg = c._transport.app.state.router.conductor.registry  # type: ignore[attr-defined]
        assert all(i.answered_at == float("-inf") for i in reg)
        r = await c.post("/v1/completions", json=body)
        a = reg.get(r.headers["x-kvc-decode"])
        assert r.status_code == 200 and a.answered_at > float("-inf")
        a.answered_at = float("-inf")
        r = await c.post("/v1/completions", json={**body, "stream": True})
        a = reg.get(r.headers["x-kvc-decode"])
        assert r.status_code == 200 and a.answered_at > float("-inf")
        ups.fail["break"] = True
        r = await c.post("/v1/completions", json={**body, "stream": True})
        assert "failed mid-stream" in r.text
        assert reg.get(r.headers["x-kvc-decode"]).answered_at == float("-inf")

    run(make_cfg(tiny_dir, TWO), tokenizer, ups, fn)
