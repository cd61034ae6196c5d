"""The peer routers of benchmarks/serving/compare.py (``smg:<policy>``, ``vllm-router:<policy>``)
started through :func:`benchmarks.serving.gateways.gateway_for` in front of two stub
OpenAI-compatible servers (no vLLM): they become ready, listen on 127.0.0.1 only, pass
completions and chat requests, streamed or not, with the benchmark's sampling fields
intact, spread them under ``round_robin`` and keep a shared prefix on one server under
``cache_aware``. A peer whose virtual environment is missing and cannot be made (no
network) is skipped."""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from benchmarks.serving.gateways import PEERS, Gateway, gateway_for, peer_python
from kvcentric.bench_serving.client import Api
from kvcentric.testing.servers import free_port
from tests.helpers.waiting import wait_until

MODEL = "bench"
GENERATE = ("/v1/completions", "/v1/chat/completions")


class Stub:
    """A vLLM-shaped OpenAI server in a thread: answers with its own name as the text and
    records every request (path, JSON body)."""

    def __init__(self, name: str, root: str) -> None:
        self.name, self.root = name, root
        self.port = free_port()
        self.lock = threading.Lock()
        self.paths: Counter[str] = Counter()
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        app = FastAPI()
        app.middleware("http")(self._record)
        app.get("/health")(lambda: Response(status_code=200))
        app.get("/version")(lambda: {"version": "0.32.0"})
        app.get("/v1/models")(self._models)
        app.get("/metrics")(self._metrics)
        for path in GENERATE:
            # vLLM 0.32 without --enable-scale-out: the render endpoints answer 403
            app.post(path + "/render")(
                lambda: JSONResponse({"error": "scale-out disabled"}, status_code=403))
        app.post("/tokenize")(self._tokenize)
        app.post("/v1/completions")(self._completions)
        app.post("/v1/chat/completions")(self._chat)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Stub:
        self.thread.start()
        assert wait_until(lambda: self.server.started, 20), f"{self.name} did not start"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)

    def reset(self) -> None:
        with self.lock:
            self.paths.clear()
            self.bodies.clear()

    def generations(self) -> list[tuple[str, dict[str, Any]]]:
        with self.lock:
            return [(p, b) for p, b in self.bodies if p in GENERATE]

    async def _record(self, request: Request, call_next: Any) -> Any:
        body = await request.body()
        with self.lock:
            self.paths[request.url.path] += 1
            if request.method == "POST":
                self.bodies.append((request.url.path, json.loads(body or b"{}")))
        return await call_next(request)

    def _models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": MODEL, "object": "model", "created": 0, "owned_by": "vllm",
            "root": self.root, "parent": None, "max_model_len": 4096}]}

    def _metrics(self) -> PlainTextResponse:
        labels = f'{{engine="0",model_name="{MODEL}"}}'
        return PlainTextResponse("".join(
            f"# TYPE vllm:{m} gauge\nvllm:{m}{labels} 0.0\n"
            for m in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")))

    async def _tokenize(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        text = body.get("prompt") or json.dumps(body.get("messages"))
        ids = [ord(c) % 1000 for c in text]
        return {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}

    async def _completions(self, request: Request) -> Any:
        return self._answer(await request.json(), chat=False)

    async def _chat(self, request: Request) -> Any:
        return self._answer(await request.json(), chat=True)

    def _answer(self, body: dict[str, Any], chat: bool) -> Any:
        obj = "chat.completion" if chat else "text_completion"
        usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}

        def choice(text: str, finish: str | None, delta: bool) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": text, "finish_reason": finish}
            key = "delta" if delta else "message"
            return {"index": 0, key: {"role": "assistant", "content": text},
                    "finish_reason": finish}

        if not body.get("stream"):
            return {"id": "x", "object": obj, "created": 0, "model": MODEL,
                    "choices": [choice(self.name, "length", False)], "usage": usage}

        def chunk(choices: list[dict[str, Any]], **more: Any) -> str:
            return "data: " + json.dumps({"id": "x", "object": obj + (".chunk" if chat else ""),
                                          "created": 0, "model": MODEL, "choices": choices,
                                          **more}) + "\n\n"

        def events() -> Iterator[str]:
            half = len(self.name) // 2
            yield chunk([choice(self.name[:half], None, True)])
            yield chunk([choice(self.name[half:], "length", True)])
            if (body.get("stream_options") or {}).get("include_usage"):
                yield chunk([], usage=usage)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def stubs(tiny_dir: str) -> Iterator[list[Stub]]:
    servers = [Stub("stub-a", tiny_dir).start(), Stub("stub-b", tiny_dir).start()]
    yield servers
    for s in servers:
        s.stop()


def peer_or_skip(kind: str) -> None:
    name = kind.split(":", 1)[0]
    try:
        peer_python(name)
    except RuntimeError as e:
        pytest.skip(f"{name} ({PEERS[name]}) absent from .peers/ and not installable: {e}")


def listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket listening in process ``pid`` and its children."""
    proc = psutil.Process(pid)
    out = []
    for p in [proc, *proc.children(recursive=True)]:
        for c in p.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                out.append((c.laddr.ip, c.laddr.port))
    return out


def post(gw: Gateway, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gw.url + path, json=body, timeout=30)


def stream_text(gw: Gateway, path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The text a streamed request delivered, and its usage; asserts it ended in [DONE]."""
    text: list[str] = []
    usage: dict[str, Any] = {}
    done = False
    with httpx.stream("POST", gw.url + path, json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, SSE keep-alive comments
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                continue
            obj = json.loads(data)
            usage = obj.get("usage") or usage
            for ch in obj.get("choices") or []:
                text.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
    assert done, "stream ended without [DONE]"
    return "".join(text), usage


def answered_by(stubs: list[Stub]) -> list[int]:
    return [len(s.generations()) for s in stubs]


@pytest.mark.parametrize("kind", ["smg:cache_aware", "smg:round_robin",
                                  "vllm-router:cache_aware", "vllm-router:round_robin"])
def test_peer_gateway_routes_to_the_servers(kind: str, stubs: list[Stub], tiny_dir: str,
                                            tmp_path: Path) -> None:
    peer_or_skip(kind)
    for s in stubs:
        s.reset()
    names = {s.name for s in stubs}
    # as compare.py calls it (router_kw carries our router's settings too)
    gw = gateway_for(kind, [s.url for s in stubs], tmp_path, model=MODEL, tokenizer=tiny_dir)
    assert gw is not None and gw.ready_count == "workers" and gw.workers == 2
    gw.start()
    try:
        gw.wait_ready(90)
        assert all(s.paths["/health"] or s.paths["/v1/models"] for s in stubs)
        socks = listeners(gw.proc.pid) if gw.proc else []
        assert (("127.0.0.1", gw.port) in socks and len(socks) >= 2
                and all(ip == "127.0.0.1" for ip, _ in socks)), socks

        # cache_aware first, on fresh prefix trees: one long shared prefix, one server
        prefix = " ".join(f"shared{i}" for i in range(300))
        for i in range(5):
            r = post(gw, "/v1/completions", {"model": MODEL, "prompt": f"{prefix} q{i}",
                                             "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] in names
        first = answered_by(stubs)
        if kind.endswith(":cache_aware"):
            assert sorted(first) == [0, 5], first
        else:
            assert sorted(first) == [2, 3], first

        # the benchmark's own requests (streamed, usage asked for, ignore_eos), both APIs
        sent: list[tuple[str, dict[str, Any]]] = []
        for i in range(4):
            comp = Api(MODEL, "completions").body(f"question {i} about topic {i * 7}", 3)
            chat = Api(MODEL, "chat").body(
                [{"role": "system", "content": f"system {i}"},
                 {"role": "user", "content": f"hello {i}"}], 3)
            for path, body in (("/v1/completions", comp), ("/v1/chat/completions", chat)):
                text, usage = stream_text(gw, path, body)
                assert text in names and usage.get("completion_tokens") == 2, (text, usage)
                sent.append((path, body))
        r = post(gw, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": "not streamed"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in names

        got = [g for s in stubs for g in s.generations()]
        assert len(got) == 5 + len(sent) + 1
        for path, body in sent:  # arrived once, with every field the benchmark relies on
            key = "prompt" if path == "/v1/completions" else "messages"
            match = [b for p, b in got if p == path and b.get(key) == body[key]]
            assert len(match) == 1, (path, body[key])
            for field in ("model", "max_tokens", "temperature", "stream", "stream_options",
                          "ignore_eos"):
                assert match[0].get(field) == body[field], (field, match[0])
        counts = answered_by(stubs)
        if kind.endswith(":round_robin"):
            assert min(counts) >= sum(counts) // 2 - 1, counts

        # token-id prompts (bench_serving's prompt format for non-text-exact tokenizers):
        # vllm-router passes them on; smg 1.13.0 accepts only text (or lists of text)
        r = post(gw, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7, 8],
                                         "max_tokens": 2})
        if kind.startswith("smg:"):
            assert r.status_code == 400 and "prompt" in r.text, r.text
        else:
            assert r.status_code == 200, r.text
            assert any(b.get("prompt") == [5, 6, 7, 8] for s in stubs
                       for _, b in s.generations())
    finally:
        gw.stop()
    assert gw.proc is not None and gw.proc.poll() is not None


def test_make_peers_installs_the_pinned_peers_before_tests_and_comparisons() -> None:
    """The Makefile's peers target installs what gateways.PEERS pins, each in .peers/, and
    both make test and make compare run it first."""
    make = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    target = make.split("\n$(PEERS_STAMP):", 1)[1].split("\n\n", 1)[0]
    for name, req in PEERS.items():
        assert re.search(rf"\.peers/{re.escape(name)}/bin/pip install .*{re.escape(req)}",
                         target), (name, req)
    assert "sglang-router==" in target
    for goal in ("test", "compare"):
        assert re.search(rf"^{goal}: setup peers$", make, flags=re.M), goal


def test_unknown_gateway_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown gateway"):
        gateway_for("nginx:round_robin", ["http://127.0.0.1:1"], tmp_path)
