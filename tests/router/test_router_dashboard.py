"""``GET /dashboard``: the page is self-contained (no external resources), and headless
Chromium renders exactly what ``/metrics`` says, from a router in this process (uvicorn
in a thread) in front of fake engines (httpx.MockTransport, as tests/router/test_router_app.py),
and shows an error banner, keeping the last numbers, when ``/metrics`` fails.
tests/e2e/test_router_e2e.py checks the same page over real vLLM engines."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from benchmarks.serving.dashboard_screenshot import chromium_path, dump_dom
from kvcentric.router.api.app import build_app
from kvcentric.router.config import RouterConfig
from kvcentric.router.cost.cost_model import Profile
from kvcentric.router.ops.dashboard import PAGE
from kvcentric.router.tokenize import PromptTokenizer
from tests.helpers.dashboard import check, read_page, scrape
from tests.helpers.served import served

PROFILE = Profile(a=0.0, b=1e-5, c=0.001, tbt_base_s=0.01, tbt_per_seq_s=0.0)
ENGINE_METRICS = ('vllm:num_requests_running{engine="0"} 3.0\n'
                  'vllm:num_requests_waiting{engine="0"} 2.0\n'
                  'vllm:kv_cache_usage_perc{engine="0"} 0.125\n')
needs_chromium = pytest.mark.skipif(chromium_path() is None,
                                    reason="chromium is not installed (make setup installs it)")


def _cfg(tiny_dir: str) -> RouterConfig:
    return RouterConfig.from_dict({
        "model": "tiny", "tokenizer": tiny_dir, "keys": {"block_size": 16},
        "instances": [{"url": "http://a:1", "name": "a"}, {"url": "http://b:1", "name": "b"}],
        "slo": {"ttft_ms": 5000, "tbt_ms": 100}, "health": {"interval_s": 600}})


class Engines:
    """Fake engines: /metrics, completions (JSON or SSE); ``down`` refuses connections."""

    def __init__(self) -> None:
        self.down = False

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/metrics":
            return httpx.Response(200, text=ENGINE_METRICS)
        if self.down:
            raise httpx.ConnectError("refused")
        if b'"stream": true' in request.content:
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  content=self._sse())
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}]})

    async def _sse(self) -> AsyncIterator[bytes]:  # a stream the router relays chunk by chunk
        yield b'data: {"choices":[{"text":"x"}]}\n\n'
        yield b"data: [DONE]\n\n"


def test_page_is_self_contained_and_published(tiny_dir: str,
                                              tokenizer: PromptTokenizer) -> None:
    app = build_app(_cfg(tiny_dir), tokenizer=tokenizer, profile=PROFILE)

    async def get() -> tuple[httpx.Response, dict[str, Any]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://router") as c:
            return await c.get("/dashboard"), (await c.get("/openapi.json")).json()

    r, schema = asyncio.run(get())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.text == PAGE and "<script>" in PAGE and 'fetch("metrics"' in PAGE
    # nothing loaded from elsewhere: no absolute URLs, no src/href, no CSS imports
    assert not re.search(r"https?:|//[a-z]|\bsrc=|\bhref=|@import|url\(", PAGE, re.I)
    doc = schema["paths"]["/dashboard"]["get"]
    assert list(doc["responses"]["200"]["content"]) == ["text/html"]


@pytest.fixture
def router(tiny_dir: str, tokenizer: PromptTokenizer) -> Iterator[tuple[str, Engines]]:
    """A router over fake engines a and b, served on a free port; yields (URL, engines)."""
    engines = Engines()
    app = build_app(_cfg(tiny_dir), transport=httpx.MockTransport(engines.handler),
                    tokenizer=tokenizer, profile=PROFILE)
    with served(app) as url:
        yield url, engines


@needs_chromium
def test_page_shows_what_metrics_says(router: tuple[str, Engines]) -> None:
    url, engines = router
    words = " ".join(f"w{i}" for i in range(80))  # several 16-token blocks
    with httpx.Client(base_url=url, timeout=30) as c:
        for i in range(6):  # repeats: the second time the engine holds the prefix
            body = {"model": "tiny", "prompt": f"{words} {i % 3}", "max_tokens": 2,
                    "stream": i % 2 == 1}
            assert c.post("/v1/completions", json=body).status_code == 200
        chat = {"model": "tiny", "messages": [{"role": "user", "content": words}]}
        assert c.post("/v1/chat/completions", json=chat).status_code == 200
        assert c.post("/v1/completions", json={"model": "tiny"}).status_code == 400
        engines.down = True  # a and b fail (502), then none is left in rotation (503)
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code \
            == 502
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "y"}).status_code \
            == 503
        page = read_page(dump_dom(url + "/dashboard"))
        samples = scrape(c.get("/metrics").text)
    check(page, samples)
    # the traffic above shows up (check() proves page == scrape; this, that it is not empty)
    assert page.ids["ttft-actual-count"] == "3" and page.ids["ttft-predicted-count"] == "9"
    assert page.metrics["kvc_router_predicted_hit_tokens_by_tier_total{tier=engine}"] != "0"
    assert page.metrics["kvc_router_rejections_total{reason=no_instance}"] == "1"
    assert page.metrics["kvc_router_requests_total{endpoint=completions,status=502}"] == "1"
    assert [r[:3] for r in page.rows["instances"]] == [["a", "both", "down"],
                                                       ["b", "both", "down"]]
    assert page.metrics["kvc_router_instance_kv_usage{instance=a}"] == "12.5%"
    assert page.metrics["kvc_router_instance_waiting{instance=b}"] == "2"
    assert page.rows["prefixes"] and page.ids["ttft-error-median"].endswith("%")


class _FailingMetrics(BaseHTTPRequestHandler):
    """Serves the page; /metrics answers once, then 500."""

    served = 0

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/dashboard":
            status, ctype, body = 200, "text/html", PAGE.encode()
        elif self.path == "/metrics" and type(self).served == 0:
            type(self).served += 1
            status, ctype, body = 200, "text/plain", b"kvc_router_ttft_actual_seconds_count 7\n"
        else:
            status, ctype, body = 500, "text/plain", b"boom"
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@needs_chromium
def test_failing_metrics_shows_a_banner_and_keeps_the_last_numbers() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FailingMetrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        dom = dump_dom(f"http://127.0.0.1:{server.server_port}/dashboard")
    finally:
        server.shutdown()
        server.server_close()
    page = read_page(dom)
    assert _FailingMetrics.served == 1
    assert "error" not in page.hidden and "HTTP 500" in page.ids["error"]
    assert page.ids["ttft-actual-count"] == "7"  # rendered once, kept through the failures
    assert page.rows["instances"] == [["no instances"]]
