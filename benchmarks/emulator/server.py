"""Run N emulated vLLM engines in one process, each on its own port.

    python -m benchmarks.emulator.server --instances 8 --profile vllm_cpu_bench
        --model bench --tokenizer .models/bench --pages 64 [--compute separate|shared|K]
        [--discipline fair|exclusive] [--interference X | --host-interference --seed N]
        [--store '{"name": ..., "capacity": "2gb"}'] [--no-kv-events] [--fleet-file F.json]

Each engine answers like vLLM's OpenAI server: ``GET /health``, ``/v1/models`` (with
``max_model_len``), ``/metrics`` (:mod:`.metrics`), ``POST /v1/completions`` and
``/v1/chat/completions`` (token-id or text prompts, tokenised with the model's own
tokenizer and chat template; streamed with ``stream_options.include_usage`` or not;
``usage.prompt_tokens_details.cached_tokens``), ``POST /reset_prefix_cache``, plus
``GET /emulator/stats`` (steps, busy time, event-loop lag), ``GET /emulator/requests``
(every finished request: hits, queueing, TTFT; ``x-request-id`` when the client sent
one) and ``POST /emulator/store`` (``{"enabled": false}``: the process's engines stop
looking up and saving in ``--store``, caching in their own pages only, until enabled
again; 404 without a store) and ``POST /emulator/loads`` (``{"async": true}``: this engine
loads store hits beside its steps, as the connector's ``async_loads`` does on a P/D decode
instance; :mod:`.engine`). Each publishes vLLM's KV events (:mod:`.events`) on its own
``tcp://*:PORT`` with a replay endpoint. Timing follows the profile (:mod:`.profile`),
scheduling vLLM's (:mod:`.engine`); engines on one ``--compute`` group share a processor
(:mod:`.processors`, ``--discipline``), or with ``--host-interference`` have one each
and slow each other by the profile's measured host interference.

``--fleet-file`` gets, once every port listens, a JSON list of the engines: ``name``,
``url``, ``kv_events``, ``kv_events_replay`` (as a router's instance config names them).

``--kind sglang`` makes every engine an SGLang server as a router sees one: its ``/metrics``
names (:func:`.metrics.render_sglang`), its KV events' structs
(:func:`.events.sglang_stored`, :func:`.events.sglang_removed`), ``GET /server_info`` (the
flat resolved arguments: ``page_size``, ``disaggregation_mode``,
``disaggregation_bootstrap_port``, ``max_total_num_tokens``, ``kv_events``). With
``--prefill-instances P`` the first P are prefill servers and the rest decode servers
(SGLang's ``--disaggregation-mode``), joined as SGLang joins them: a request to either must
carry ``bootstrap_room`` (a decode's also the ``bootstrap_host`` and ``bootstrap_port`` of a
prefill server of this fleet, else 400); a prefill server computes the prompt and answers
one token, handing the KV to the room; a decode server waits for the room's KV (at most
``TRANSFER_TIMEOUT_S``, then 500), loads it at the profile's load bandwidth and decodes. The
fleet file then names each engine's ``kind`` and ``role`` (a prefill server's bootstrap port
is left for the router to read from ``/server_info``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import time
import uuid
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn
import zmq.asyncio
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from benchmarks.lib.capacity import paper_tbt
from kvcentric.router.tokenize import PromptTokenizer
from kvcentric.testing.servers import free_port

from .connector import StoreHits
from .engine import EngineCore, Request
from .events import Publisher
from .metrics import Latencies, render, render_sglang
from .processors import DISCIPLINES, ExclusiveProcessor, Processor, processors
from .profile import EngineProfile, load

TRANSFER_TIMEOUT_S = 30.0  # a decode server's wait for its room's KV


class EmulatedEngine:
    """One engine: scheduler core, its processor, its event publisher, its latencies."""

    def __init__(self, name: str, profile: EngineProfile, pages: int,
                 proc: Processor | ExclusiveProcessor,
                 connector: StoreHits | None, publisher: Publisher | None,
                 mode: str = "unified", bootstrap_port: int | None = None) -> None:
        self.name = name
        self.mode = mode  # SGLang's disaggregation mode: unified, prefill or decode
        self.bootstrap_port = bootstrap_port  # a prefill server's
        self.core = EngineCore(profile, pages, connector)
        self.proc = proc
        self.pub = publisher
        self.lat = Latencies()
        self.wake = asyncio.Event()
        self.lag_s: list[float] = []  # per step: how late the step ended (loop overload)
        self.task: asyncio.Task[None] | None = None
        self.ids: dict[str, str] = {}  # emulator rid -> the client's x-request-id

    def start(self) -> None:
        if self.pub is not None:
            self.pub.start()
        self.task = asyncio.get_running_loop().create_task(self._run())

    def submit(self, req: Request) -> None:
        self.core.add(req)
        self.wake.set()

    async def _run(self) -> None:
        core = self.core
        while True:
            now = time.monotonic()
            step = core.plan(now)
            if step is None:
                self.wake.clear()
                loaded = core.next_load_s(now)  # a request's asynchronous load ends then
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), loaded)
                continue
            t0 = time.monotonic()
            await self.proc.run(step.work_s, self.name)
            now = time.monotonic()
            if len(self.lag_s) < 200_000:
                self.lag_s.append(max(0.0, now - t0 - step.work_s))
            done = core.finish(step, now)
            for r, _ in step.chunks:
                if r.t_first == now and r.t_last is None:
                    self.lat.ttft.observe(now - r.arrival)
                    self.lat.queue.observe((r.t_admit or now) - r.arrival)
                    r.t_last = now
            for r in step.decodes:
                if not r.aborted and r.t_last is not None:
                    self.lat.itl.observe(now - r.t_last)
                    r.gaps.append(now - r.t_last)
                    r.t_last = now
            for r in done:
                self.lat.e2e.observe(now - r.arrival)
            if self.pub is not None:
                self.pub.publish(core.cache.take_events())
            else:
                core.cache.take_events()

    def stats(self) -> dict[str, Any]:
        lag = sorted(self.lag_s)
        k = self.core.counters

        def q(p: float) -> float | None:
            return lag[min(len(lag) - 1, int(p * len(lag)))] if lag else None

        return {"name": self.name, "steps": k.steps, "busy_s": k.busy_s,
                "requests": k.requests, "finished": k.finished, "aborted": k.aborted,
                "running": len(self.core.running), "waiting": len(self.core.waiting),
                "cached_pages": self.core.cache.cached_pages(),
                "evicted_pages": self.core.cache.evicted,
                "lag_p50_s": q(0.5), "lag_p99_s": q(0.99), "lag_max_s": lag[-1] if lag else None,
                "event_seq": self.pub.seq if self.pub else None,
                "replays_served": self.pub.replays if self.pub else 0}

    def records(self) -> list[dict[str, Any]]:
        return [{"engine": self.name, "rid": r.rid, "request_id": self.ids.get(r.rid),
                 "prompt_tokens": r.n, "max_tokens": r.max_tokens, "arrival": r.arrival,
                 "admitted": r.t_admit, "first_token": r.t_first, "done": r.t_done,
                 "local_hit": r.local_hit, "external_hit": r.external_hit,
                 "load_s": r.load_s, "tbt_s": paper_tbt(r.gaps)}
                for r in self.core.finished]


class Fleet:
    """Every engine of this process and what they share (tokenizer, output words).

    Text made only of the tokenizer's word tokens (a space and letters, each its own
    token: what :class:`kvcentric.bench_serving.tokens.TokenSource` builds prompts from) is
    tokenised by splitting on spaces and looking the words up (checked at start against
    the tokenizer on a probe text; ~50x cheaper than the BPE on this 2-core machine);
    any other text goes through the tokenizer."""

    def __init__(self, model: str, tokenizer: PromptTokenizer, max_model_len: int,
                 kind: str = "vllm") -> None:
        self.model = model
        self.kind = kind  # the engines speak vLLM's or SGLang's formats
        self.rooms: dict[int, asyncio.Future[list[int]]] = {}  # bootstrap room -> its KV
        self.bootstrap: dict[int, EmulatedEngine] = {}  # bootstrap port -> prefill server
        self.tok = tokenizer
        self.max_model_len = max_model_len
        self.by_port: dict[int, EmulatedEngine] = {}
        self.words, self.texts = _output_words(tokenizer)
        self.word_ids, self.bos = _word_index(tokenizer)
        self.loop_lag: list[tuple[float, float]] = []  # (when, how late a 10 ms sleep woke)

    async def watch_loop(self) -> None:
        """Record the event loop's lateness (a late loop delays every engine and the
        arrival of every request)."""
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            if len(self.loop_lag) >= 100_000:
                del self.loop_lag[:50_000]
            now = time.monotonic()
            self.loop_lag.append((now, max(0.0, now - t - 0.01)))

    def fast_ids(self, body: dict[str, Any]) -> np.ndarray | None:
        """A completions prompt's ids by word lookup, or None (use the tokenizer)."""
        text = body.get("prompt")
        if not isinstance(text, str) or not text.startswith(" ") or not self.word_ids:
            return None
        get = self.word_ids.get
        ids = [get(w) for w in text[1:].split(" ")]
        if None in ids:
            return None
        head = self.bos if body.get("add_special_tokens", True) else []
        return np.asarray([*head, *ids], dtype=np.uint32)

    def room(self, room: int) -> asyncio.Future[list[int]]:
        """The KV handed over in bootstrap room ``room`` (made by whichever side comes
        first; the decode side removes it)."""
        fut = self.rooms.get(room)
        if fut is None:
            fut = self.rooms[room] = asyncio.get_running_loop().create_future()
        return fut

    def pd_check(self, e: EmulatedEngine, body: dict[str, Any]) -> tuple[int, str | None]:
        """The request's bootstrap room, or why SGLang would refuse it on ``e``."""
        room = body.get("bootstrap_room")
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 2**63:
            return 0, f"bootstrap_room is required in {e.mode} mode (a non-negative int64)"
        if e.mode == "decode":
            port = body.get("bootstrap_port")
            if not isinstance(body.get("bootstrap_host"), str) or port not in self.bootstrap:
                return 0, (f"bootstrap_host and bootstrap_port must name a prefill server "
                           f"(got {body.get('bootstrap_host')!r}:{port!r})")
        return room, None

    def next_token(self, rid: str) -> Any:
        """The ``i``-th output token of request ``rid`` (a word token)."""
        base = zlib.crc32(rid.encode())
        words = self.words
        return lambda i: words[(base + 7919 * i) % len(words)]


def _word_index(tok: PromptTokenizer) -> tuple[dict[str, int], list[int]]:
    """Word -> id for the tokenizer's exact word tokens, and the ids it adds in front of
    a prompt; empty when a probe text shows the lookup would differ from the tokenizer."""
    from kvcentric.bench_serving.tokens import TokenSource

    src = TokenSource(tok.tok.name_or_path)
    if not src.text_exact:
        return {}, []
    index = {src.text([w])[1:]: w for w in src.words}
    probe = src.text([src.words[(i * 7919) % len(src.words)] for i in range(512)])
    plain = list(tok.encode(probe, add_special_tokens=False))
    full = list(tok.encode(probe))
    bos = full[:len(full) - len(plain)]
    if full[len(bos):] != plain or [index.get(w) for w in probe[1:].split(" ")] != plain:
        return {}, []
    return index, [int(b) for b in bos]


def _output_words(tok: PromptTokenizer) -> tuple[list[int], dict[int, str]]:
    """Tokens answers are made of: ids whose text is a space and letters and that encode
    back to themselves (a client re-sending the answer as text gets the same ids)."""
    words, texts = [], {}
    for i in range(min(len(tok.tok), 20000)):
        text = str(tok.tok.decode([i]))
        if len(text) > 1 and text[0] == " " and text[1:].isascii() and text[1:].isalpha():
            if list(tok.encode(text, add_special_tokens=False)) == [i]:
                words.append(i)
                texts[i] = text
        if len(words) >= 256:
            break
    if not words:  # a tokenizer without word tokens: any token, text as decoded
        words = list(range(100, 356))
        texts = {i: str(tok.tok.decode([i])) for i in words}
    return words, texts


def _err(status: int, message: str) -> JSONResponse:
    return JSONResponse({"object": "error", "message": message, "type": "BadRequestError",
                         "code": status}, status_code=status)


def build_app(fleet: Fleet) -> Starlette:
    def engine(request: HttpRequest) -> EmulatedEngine:
        server = request.scope.get("server") or ("", 0)
        return fleet.by_port[int(server[1])]

    async def health(request: HttpRequest) -> Response:
        return Response(status_code=200)

    async def server_info(request: HttpRequest) -> Response:
        if fleet.kind != "sglang":
            return Response(status_code=404)
        e = engine(request)
        ev = e.pub
        return JSONResponse({
            "served_model_name": fleet.model, "page_size": e.core.p.page_size,
            "context_length": fleet.max_model_len, "disaggregation_mode":
            "null" if e.mode == "unified" else e.mode,
            "disaggregation_bootstrap_port": e.bootstrap_port,
            "max_total_num_tokens": e.core.cache.capacity * e.core.p.page_size,
            "kv_events": None if ev is None else {
                "publisher": "zmq", "endpoint_host": "*",
                "endpoint_port_base": int(ev.endpoint.rsplit(":", 1)[1]), "topic": "",
                "block_size": e.core.p.page_size, "dp_size": 1}})

    async def models(request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": fleet.model, "object": "model", "owned_by": "emulator", "created": 0,
             "root": fleet.model, "max_model_len": fleet.max_model_len}]})

    async def metrics(request: HttpRequest) -> Response:
        e = engine(request)
        if fleet.kind == "sglang":
            return PlainTextResponse(render_sglang(e.core, fleet.model, e.mode))
        return PlainTextResponse(render(e.core, e.lat, fleet.model))

    async def reset(request: HttpRequest) -> Response:
        ok = engine(request).core.cache.clear()
        return Response(status_code=200 if ok else 400)

    async def stats(request: HttpRequest) -> Response:
        """``?since=T`` (``time.monotonic()``, system-wide): the loop's lateness since T."""
        since = float(request.query_params.get("since", "0") or 0)
        lag = sorted(x for t, x in fleet.loop_lag if t >= since)
        return JSONResponse({**engine(request).stats(),
                             "loop_lag_p99_s": lag[int(0.99 * len(lag))] if lag else None,
                             "loop_lag_max_s": lag[-1] if lag else None})

    async def records(request: HttpRequest) -> Response:
        return JSONResponse(engine(request).records())

    async def flag(request: HttpRequest, key: str) -> bool | None:
        """The body's ``{key: true|false}``, or None when it is not that."""
        try:
            body = await request.json()
        except ValueError:
            return None
        value = body.get(key) if isinstance(body, dict) else None
        return value if isinstance(value, bool) else None

    async def loads(request: HttpRequest) -> Response:
        on = await flag(request, "async")
        if on is None:
            return _err(400, 'the body must be {"async": true|false}')
        engine(request).core.async_loads = on
        return JSONResponse({"async": on})

    async def store(request: HttpRequest) -> Response:
        conn = engine(request).core.connector
        if conn is None:
            return _err(404, "this emulator runs without a store (--store)")
        enabled = await flag(request, "enabled")
        if enabled is None:
            return _err(400, 'the body must be {"enabled": true|false}')
        conn.enabled = enabled
        return JSONResponse({"enabled": enabled})

    async def completion(request: HttpRequest) -> Response:
        arrival = time.monotonic()
        e = engine(request)
        chat = request.url.path.endswith("chat/completions")
        try:
            body = json.loads(await request.body())
            if body.get("model") not in (None, fleet.model):
                return _err(404, f"The model `{body.get('model')}` does not exist.")
            prompt = body.get("prompt")
            if chat:
                ids = await asyncio.to_thread(fleet.tok.chat_ids, body)
            elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                ids = fleet.tok.completion_ids(body)
            elif (fast := fleet.fast_ids(body)) is not None:
                ids = fast
            else:
                ids = await asyncio.to_thread(fleet.tok.completion_ids, body)
        except (ValueError, TypeError) as exc:
            return _err(400, str(exc))
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        if len(ids) + max_tokens > fleet.max_model_len:
            return _err(400, f"This model's maximum context length is {fleet.max_model_len} "
                             f"tokens. However, you requested {len(ids) + max_tokens} tokens.")
        prompt_ids: list[int] = ids.tolist()
        transferred = 0
        handoff: asyncio.Future[list[int]] | None = None
        if e.mode != "unified":
            room, why = fleet.pd_check(e, body)
            if why is not None:
                return _err(400, why)
            if e.mode == "prefill":
                max_tokens, handoff = 1, fleet.room(room)  # SGLang's prefill: one token
            else:
                try:
                    kv = await asyncio.wait_for(asyncio.shield(fleet.room(room)),
                                                TRANSFER_TIMEOUT_S)
                except TimeoutError:
                    return _err(500, f"KV transfer of bootstrap room {room} timed out")
                finally:
                    fleet.rooms.pop(room, None)
                if kv != prompt_ids:
                    return _err(500, f"bootstrap room {room} holds another prompt's KV")
                transferred = len(prompt_ids) - 1
        rid = uuid.uuid4().hex
        if request.headers.get("x-request-id"):
            e.ids[rid] = request.headers["x-request-id"]
        queue: asyncio.Queue[tuple[int, bool]] = asyncio.Queue()

        def on_token(t: int, last: bool) -> None:
            if handoff is not None and not handoff.done():
                handoff.set_result(prompt_ids)  # the prefill is done: its KV goes over
            queue.put_nowait((t, last))

        req = Request(rid, prompt_ids, max(1, max_tokens), body.get("cache_salt"),
                      arrival, on_token, fleet.next_token(rid), transferred=transferred)
        await asyncio.sleep(e.core.p.api_s)
        e.submit(req)
        kind = "chat.completion" if chat else "text_completion"
        created = int(time.time())

        def usage() -> dict[str, Any]:
            return {"prompt_tokens": req.n, "completion_tokens": req.output,
                    "total_tokens": req.n + req.output,
                    "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}

        def choice(text: str, finish: str | None, first: bool) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"content": text}
                if first:
                    delta["role"] = "assistant"
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        if not body.get("stream"):
            texts = []
            try:
                while True:
                    tok, last = await queue.get()
                    texts.append(fleet.texts.get(tok, " x"))
                    if last:
                        break
            finally:
                e.core.abort(req)  # a no-op once done
            text = "".join(texts)
            ch: dict[str, Any] = ({"index": 0, "message": {"role": "assistant",
                                                           "content": text},
                                   "finish_reason": "length"} if chat else
                                  {"index": 0, "text": text, "finish_reason": "length"})
            return JSONResponse({"id": f"cmpl-{rid}", "object": kind, "created": created,
                                 "model": fleet.model, "choices": [ch], "usage": usage()})

        with_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def sse() -> AsyncIterator[bytes]:
            head = {"id": f"cmpl-{rid}", "object": kind + ("" if not chat else ".chunk"),
                    "created": created, "model": fleet.model}
            first = True
            try:
                while True:
                    tok, last = await queue.get()
                    chunk = {**head, "choices": [choice(fleet.texts.get(tok, " x"),
                                                        "length" if last else None, first)]}
                    first = False
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                    if last:
                        break
                if with_usage:
                    tail = {**head, "choices": [], "usage": usage()}
                    yield f"data: {json.dumps(tail)}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                e.core.abort(req)

        return StreamingResponse(sse(), media_type="text/event-stream")

    async def render_refused(request: HttpRequest) -> Response:
        # vLLM serves /render only with --enable-scale-out (peers then route on text)
        return _err(403, "render endpoints need --enable-scale-out")

    return Starlette(routes=[
        Route("/v1/completions/render", render_refused, methods=["POST"]),
        Route("/v1/chat/completions/render", render_refused, methods=["POST"]),
        Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
        Route("/server_info", server_info),
        Route("/reset_prefix_cache", reset, methods=["POST"]),
        Route("/emulator/stats", stats), Route("/emulator/requests", records),
        Route("/emulator/store", store, methods=["POST"]),
        Route("/emulator/loads", loads, methods=["POST"]),
        Route("/v1/completions", completion, methods=["POST"]),
        Route("/v1/chat/completions", completion, methods=["POST"])])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--instances", type=int, required=True)
    ap.add_argument("--profile", default="vllm_cpu_bench", help="profile name or JSON path")
    ap.add_argument("--model", default="bench")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--pages", type=int, default=64, help="KV cache pages per engine")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--compute", default="separate", help="separate | shared | K per group")
    ap.add_argument("--dilation", type=float, default=1.0,
                    help="run every engine this many times slower (see EngineProfile.dilated)")
    ap.add_argument("--discipline", choices=DISCIPLINES, default="fair",
                    help="how engines on one --compute group share it (exclusive: one at "
                         "a time, the profile's shared_handoff_s after the holder's last step)")
    ap.add_argument("--slowdown", type=float, default=1.0,
                    help="extra slowdown of a processor shared by busy engines (>= 1)")
    ap.add_argument("--interference", type=float, default=1.0,
                    help="with --discipline fair: with k engines of a group in a step "
                         "each runs at 1/(1 + X(k-1)) of full speed (1: one processor "
                         "shared; the profile's host_interference: cores of one host)")
    ap.add_argument("--host-interference", action="store_true",
                    help="with --discipline fair: each step's X drawn from the profile's "
                         "host_interference_samples (its host_interference without them)")
    ap.add_argument("--seed", type=int, default=0, help="seeds those draws")
    ap.add_argument("--store", default=None, help="local store config (JSON): store hits")
    ap.add_argument("--object-bytes", type=int, default=256)
    ap.add_argument("--no-kv-events", action="store_true")
    ap.add_argument("--kind", choices=("vllm", "sglang"), default="vllm",
                    help="whose formats the engines speak (metrics, KV events, P/D)")
    ap.add_argument("--prefill-instances", type=int, default=0,
                    help="with --kind sglang: the first P engines are prefill servers, the "
                         "rest decode servers (0: every engine unified)")
    ap.add_argument("--fleet-file", type=Path, default=None)
    ap.add_argument("--cprofile", default=None, help="write cProfile stats here at exit")
    args = ap.parse_args(argv)
    if args.prefill_instances and (args.kind != "sglang"
                                   or not 0 < args.prefill_instances < args.instances):
        ap.error("--prefill-instances needs --kind sglang and fewer than --instances")
    prof = load(args.profile).dilated(args.dilation)
    tok = PromptTokenizer(args.tokenizer)
    # vLLM does not start when one sequence of max_model_len cannot fit in its KV cache;
    # here the context is cut to what the cache holds, so a prompt no engine could ever
    # admit is refused (400) instead of waiting at the head of the queue for ever
    fleet = Fleet(args.model, tok, min(args.max_model_len, args.pages * prof.page_size),
                  args.kind)
    connector = None
    if args.store:
        from kvcentric.store import open_store

        store = open_store({**json.loads(args.store), "prefault": False})
        connector = StoreHits(store, args.model, prof.page_size, args.object_bytes)
    x: float = args.interference
    samples: tuple[float, ...] = ()
    if args.host_interference:
        x, samples = prof.host_interference, prof.host_interference_samples
    procs = processors(args.instances, args.compute, args.slowdown, args.discipline,
                       prof.shared_handoff_s, x, samples, args.seed)
    socks, specs = [], []
    for _ in range(args.instances):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        for _attempt in range(20):
            with contextlib.suppress(OSError):
                s.bind(("127.0.0.1", free_port()))
                break
        socks.append(s)
    app = build_app(fleet)
    ctx = zmq.asyncio.Context()
    tasks: set[asyncio.Task[None]] = set()

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            for i, (s, proc) in enumerate(zip(socks, procs)):
                port = int(s.getsockname()[1])
                ev = None
                spec: dict[str, Any] = {"name": f"emu{i}", "url": f"http://127.0.0.1:{port}"}
                if not args.no_kv_events:
                    pe, pr = free_port(), free_port()
                    ev = Publisher(ctx, f"tcp://*:{pe}", f"tcp://*:{pr}", kind=args.kind)
                    spec |= {"kv_events": f"tcp://*:{pe}", "kv_events_replay": f"tcp://*:{pr}"}
                mode, boot = "unified", None
                if args.kind == "sglang":
                    spec["kind"] = "sglang"
                    if args.prefill_instances:
                        mode = "prefill" if i < args.prefill_instances else "decode"
                        spec["role"] = mode
                        boot = free_port() if mode == "prefill" else None
                eng = EmulatedEngine(spec["name"], prof, args.pages, proc, connector, ev,
                                     mode, boot)
                eng.core.cache.kind = args.kind
                if boot is not None:
                    fleet.bootstrap[boot] = eng
                fleet.by_port[port] = eng
                eng.start()
                specs.append(spec)
            watcher = asyncio.get_running_loop().create_task(fleet.watch_loop())
            tasks.add(watcher)
            await super().startup(sockets)
            if args.fleet_file is not None:
                tmp = args.fleet_file.with_suffix(".tmp")
                tmp.write_text(json.dumps(specs, indent=1))
                tmp.replace(args.fleet_file)

    server = Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                   timeout_keep_alive=600))
    if args.cprofile:  # uvicorn re-raises SIGTERM after shutdown: dump before that
        import cProfile

        prof_ = cProfile.Profile()
        down = server.shutdown

        async def shutdown(sockets: list[socket.socket] | None = None) -> None:
            prof_.disable()
            prof_.dump_stats(args.cprofile)
            await down(sockets)

        server.shutdown = shutdown  # type: ignore[method-assign]
        prof_.enable()
    server.run(sockets=socks)
    ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
