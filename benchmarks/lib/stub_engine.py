"""Stub OpenAI-compatible engines: the router's upstreams without vLLM (router-only soaks).

    python -m benchmarks.lib.stub_engine --ports 8101,8102 --model tiny --tokenizer .models/tiny
                                     [--store '{"name": ..., "runtime_dir": ...}']
                                     [--pages 2048] [--page-size 128]

One process answers on every port (one uvicorn server, one pre-bound socket per port; the
instance is told apart by the port): ``GET /health``, ``/v1/models``, ``/metrics`` (the
vLLM gauges the router reads: running, waiting, KV usage and ``cache_config_info`` with
``--pages`` pages of ``--page-size`` tokens), ``POST /v1/completions`` and
``/v1/chat/completions``, streamed (three SSE chunks and ``[DONE]``; with
``--stream-tokens``, one chunk per requested token as vLLM streams) or not, at once or
after a random ``--latency-ms`` (an engine's time: requests then overlap as with vLLM).

With ``--store`` (a local store's config, as in the router's ``store`` section) a request
does what the connector would at prefill end: the prompt's full blocks (chained hashes of
``--page-size`` tokens, the tokens the router hashes: the same tokenizer and chat
template) and its tail are put in the store under one layout signature, ``--object-bytes``
each, so the router's store view sees hits, misses and evictions as with real engines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvcentric.hashing import KeySpace, block_hashes, hash_seed, prompt_tail
from kvcentric.router.tokenize import PromptTokenizer
from kvcentric.store import KVStore, StoreUnavailable, open_store

LAYOUT_SIG = "5705ab5e5705ab5e"  # any 16 hex digits: the router discovers it


class Saver:
    """Puts a prompt's blocks and tail in the store, like the connector at prefill end."""

    def __init__(self, store: KVStore, model: str, block_size: int, object_bytes: int) -> None:
        self.store = store
        self.model = model
        self.block_size = block_size
        self.keys = KeySpace(model, LAYOUT_SIG)
        self.data = np.zeros(object_bytes, dtype=np.uint8)

    def save(self, tokens: np.ndarray, salt: str | None) -> None:
        seed = hash_seed(self.model, salt)
        hashes = block_hashes(tokens, self.block_size, seed)
        keys = self.keys.keys(hashes)
        tail = prompt_tail(tokens, self.block_size, seed, hashes)
        try:
            have = self.store.batch_exists(keys) if keys else 0
            new = keys[have:]
            if tail is not None:
                new.append(self.keys.tail_key(tail))
            if new:
                parents = [keys[have - 1] if have else None, *new[:-1]]
                ptr, n = self.data.ctypes.data, self.data.nbytes
                self.store.batch_put_from(new, [ptr] * len(new), [n] * len(new), parents)
        except (StoreUnavailable, OSError):
            pass  # a stub: the next request tries again


_HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
               "e2e_request_latency_seconds", "request_queue_time_seconds",
               "request_prefill_time_seconds", "request_decode_time_seconds",
               "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total")
_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


def vllm_histograms(model: str, n: int) -> str:
    """The bulk of a vLLM ``/metrics`` page (its histograms, counts growing with ``n``), so
    the router parses as much text per poll as from a real engine."""
    lab = f'engine="0",model_name="{model}"'
    out = []
    for h in _HISTOGRAMS:
        out += [f"# HELP vllm:{h} Histogram of {h}.", f"# TYPE vllm:{h} histogram"]
        out += [f'vllm:{h}_bucket{{{lab},le="{b}"}} {n * (i + 1)}.0'
                for i, b in enumerate(_BUCKETS)]
        out += [f'vllm:{h}_bucket{{{lab},le="+Inf"}} {n * 21}.0',
                f"vllm:{h}_count{{{lab}}} {n * 21}.0", f"vllm:{h}_sum{{{lab}}} {n * 0.37}"]
    for c in ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
              "prefix_cache_hits_total", "num_preemptions_total"):
        out += [f"# HELP vllm:{c} Counter.", f"# TYPE vllm:{c} counter",
                f"vllm:{c}{{{lab}}} {n * 97}.0"]
    return "\n".join(out) + "\n"


def build_app(model: str, tokenizer: PromptTokenizer, ports: list[int], pages: int,
              page_size: int, saver: Saver | None,
              latency_s: tuple[float, float] = (0.0, 0.0),
              stream_tokens: bool = False) -> Starlette:
    """The stub's app; ``stream_tokens``: a streamed answer has ``max_tokens`` chunks
    (else three)."""
    names = {p: f"e{i}" for i, p in enumerate(ports)}
    running = dict.fromkeys(names.values(), 0)
    served = dict.fromkeys(names.values(), 0)

    def name(request: Request) -> str:
        server = request.scope.get("server") or ("", 0)
        return names.get(int(server[1]), "e?")

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model, "object": "model", "owned_by": "stub", "created": 0}]})

    async def metrics(request: Request) -> Response:
        n = name(request)
        served[n] += 1
        return PlainTextResponse(
            f'vllm:num_requests_running{{engine="0",model_name="{model}"}} {running[n]}.0\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="{model}"}} 0.0\n'
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} 0.5\n'
            f'vllm:cache_config_info{{block_size="{page_size}",engine="0",'
            f'num_gpu_blocks="{pages}"}} 1.0\n' + vllm_histograms(model, served[n]))

    async def completion(request: Request) -> Response:
        chat = request.url.path.endswith("chat/completions")
        body = json.loads(await request.body())
        n = name(request)
        if saver is not None:
            try:
                tokens = tokenizer.chat_ids(body) if chat else tokenizer.completion_ids(body)
            except ValueError as exc:
                return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
            saver.save(tokens, body.get("cache_salt"))
        usage = {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11}
        delay = random.uniform(*latency_s)
        if not body.get("stream"):
            running[n] += 1
            try:
                await asyncio.sleep(delay)
            finally:
                running[n] -= 1
            choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant",
                                                               "content": " ok ok ok"},
                                       "finish_reason": "length"} if chat else
                                      {"index": 0, "text": " ok ok ok", "finish_reason": "length"})
            return JSONResponse({"id": f"cmpl-{n}", "object": "chat.completion" if chat else
                                 "text_completion", "model": model, "choices": [choice],
                                 "usage": usage})

        chunks = max(1, int(body.get("max_tokens") or 1)) if stream_tokens else 3

        async def sse() -> AsyncIterator[bytes]:
            running[n] += 1
            try:
                for i in range(chunks):
                    delta = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
                    chunk = {"id": f"cmpl-{n}", "model": model,
                             "choices": [{"index": 0, **delta, "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                    await asyncio.sleep(delay / chunks)
                yield b"data: [DONE]\n\n"
            finally:
                running[n] -= 1

        return StreamingResponse(sse(), media_type="text/event-stream")

    return Starlette(routes=[
        Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
        Route("/v1/completions", completion, methods=["POST"]),
        Route("/v1/chat/completions", completion, methods=["POST"])])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ports", required=True, help="comma-separated ports, one per engine")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokenizer", required=True, help="model folder (tokenizer)")
    ap.add_argument("--store", default=None, help="local store config as JSON (optional)")
    ap.add_argument("--pages", type=int, default=2048, help="KV cache pages reported")
    ap.add_argument("--page-size", type=int, default=128, help="tokens per page")
    ap.add_argument("--object-bytes", type=int, default=4096, help="bytes per stored block")
    ap.add_argument("--latency-ms", default="0,0",
                    help="LO,HI: each answer takes a uniform random time in [LO, HI] ms")
    ap.add_argument("--stream-tokens", action="store_true",
                    help="stream one chunk per requested token (max_tokens), not three")
    args = ap.parse_args(argv)
    ports = [int(p) for p in args.ports.split(",")]
    tok = PromptTokenizer(args.tokenizer)
    saver = None
    if args.store:
        store = open_store({**json.loads(args.store), "autostart": False, "prefault": False})
        saver = Saver(store, args.model, args.page_size, args.object_bytes)
    socks = []
    for port in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((args.host, port))
        socks.append(s)
    lo, hi = (float(x) / 1e3 for x in args.latency_ms.split(","))
    app = build_app(args.model, tok, ports, args.pages, args.page_size, saver, (lo, hi),
                    args.stream_tokens)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    server.run(sockets=socks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
