"""The router's FastAPI app: OpenAI-compatible front, instance admin, health and metrics.

``build_app(cfg)`` wires everything; nothing runs at import. The lifespan starts the
upstream HTTP client, one KV event listener per instance that publishes events, and the
health/metrics poll loop, and stops them on shutdown.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed or not),
``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``GET /dashboard`` (a live HTML
status page over ``/metrics``), ``GET/POST /instances``, ``DELETE /instances/{name}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np
import zmq.asyncio
from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvcentric.router import api_models, limits
from kvcentric.router import instances as inst_mod
from kvcentric.router.auth import CLIENT_SALT_MAX, SALT_MAX, Authenticator, Caller
from kvcentric.router.config import RouterConfig
from kvcentric.router.cost_model import Profile, kv_bytes_per_token
from kvcentric.router.dashboard import dashboard_routes
from kvcentric.router.errors import Refused, error_response
from kvcentric.router.instance_spec import InstanceSpec
from kvcentric.router.instances import Instance
from kvcentric.router.kv_events import EventListener, EventTranslator, router_binds
from kvcentric.router.metrics import RouterMetrics
from kvcentric.router.openapi import build_openapi
from kvcentric.router.proxy import Proxy
from kvcentric.router.replication import Replicator
from kvcentric.router.scheduler import Conductor
from kvcentric.router.store_view import StoreView
from kvcentric.router.tokenize import PromptTokenizer
from kvcentric.stored_layout import stored_block_size

# ZMQ closes a removed instance's event socket on its I/O thread, a moment after the
# DELETE answers: re-adding the instance at once could find its port still bound (seen in
# a full test run under load: DELETE then POST of the same instance, 409). A bind refused
# as in use is retried for this long before the POST answers 409.
REBIND_WAIT_S = 2.0

log = logging.getLogger("router.app")


@dataclass
class RouterState:
    cfg: RouterConfig
    conductor: Conductor
    tokenizer: PromptTokenizer
    metrics: RouterMetrics
    auth: Authenticator
    inflight: limits.InFlight
    completion_model: type[BaseModel]
    chat_model: type[BaseModel]
    transport: httpx.AsyncBaseTransport | None = None
    proxy: Proxy | None = None
    replicator: Replicator | None = None
    client: httpx.AsyncClient | None = None
    zmq_ctx: zmq.asyncio.Context | None = None
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    # ---- instances ----
    def add_instance(self, spec: InstanceSpec) -> Instance:
        """Register ``spec`` and start its event listener; a listener that cannot be made
        (``zmq.ZMQError``: an address this host cannot take) leaves nothing registered."""
        inst = self.conductor.registry.add(spec)
        if spec.kv_events and self.zmq_ctx is not None:
            try:
                self._listen(inst)
            except zmq.ZMQError:
                self.conductor.registry.remove(inst.name)
                raise
        return inst

    async def add_instance_rebinding(self, spec: InstanceSpec) -> Instance:
        """:meth:`add_instance`, retrying a bind refused as in use for ``REBIND_WAIT_S``
        (e.g. the port of an instance just removed, whose socket ZMQ is still closing)."""
        deadline = time.monotonic() + REBIND_WAIT_S
        while True:
            try:
                return self.add_instance(spec)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.02)

    def _listen(self, inst: Instance) -> None:
        spec = inst.spec
        assert spec.kv_events is not None and self.zmq_ctx is not None
        tr = EventTranslator(self.cfg.model_id, self.conductor.block_size)
        index, slot = self.conductor.index, inst.slot

        def on_events(events: list[dict[str, Any]]) -> None:
            for ev in events:
                kind = ev.get("type")
                if kind == "BlockStored":
                    index.add(slot, tr.stored(ev))
                elif kind == "BlockRemoved":
                    index.remove(slot, tr.removed(ev))
                elif kind == "AllBlocksCleared":
                    tr.cleared()
                    index.clear(slot)

        inst.translator = tr
        # "tcp://*:PORT": the engine binds every interface; the router reaches it by its host
        host = urlparse(spec.url).hostname or "127.0.0.1"
        endpoint = spec.kv_events.replace("*", host)
        replay = spec.kv_events_replay.replace("*", host) if spec.kv_events_replay else None
        inst.listener = EventListener(self.zmq_ctx, endpoint, on_events,
                                      bind=router_binds(spec.kv_events), replay=replay,
                                      ready=lambda: tr.block_bytes > 0)
        self.tasks[f"events:{inst.name}"] = asyncio.get_running_loop().create_task(
            inst.listener.run())

    def remove_instance(self, name: str) -> Instance:
        task = self.tasks.pop(f"events:{name}", None)
        if task is not None:
            task.cancel()
        return self.conductor.registry.remove(name)  # closes the socket now: port reusable

    async def health_loop(self) -> None:
        hc = self.cfg.health
        c = self.conductor
        assert self.client is not None
        while True:
            await asyncio.gather(*(inst_mod.check(i, c.registry, self.client, hc)
                                   for i in c.registry))
            if c.block_size is None:
                page = next((i.stats.page_size for i in c.registry if i.stats.page_size), None)
                if page:  # the connector's own default for this page size
                    c.set_block_size(stored_block_size(page))
            if c.block_size is not None:
                for i in c.registry:
                    inst_mod.fit_capacity(i, c.index, c.block_size)
            await asyncio.sleep(hc.interval_s)


def build_state(cfg: RouterConfig, *, transport: httpx.AsyncBaseTransport | None = None,
                tokenizer: PromptTokenizer | None = None,
                profile: Profile | None = None) -> RouterState:
    """Everything the app needs, built from ``cfg`` (files are read here, once)."""
    if profile is None:
        if cfg.cost.profile:
            profile = Profile.load(cfg.cost.profile)
        else:
            log.warning("no cost profile configured: using default prefill costs; run "
                        "`kvcentric-router profile` for predictions worth the name")
            profile = Profile()
    kvb = cfg.cost.kv_bytes_per_token or kv_bytes_per_token(cfg.tokenizer, cfg.cost.kv_dtype)
    store = StoreView(cfg.store, cfg.model_id, layout_sig=cfg.keys.layout_sig,
                      tp_size=cfg.keys.tp_size, ttl_s=cfg.cache.store_ttl_s,
                      negative_ttl_s=cfg.cache.store_negative_ttl_s)
    conductor = Conductor(cfg, profile, kvb, store)
    tokenizer = tokenizer or PromptTokenizer(cfg.tokenizer)
    salt_max = CLIENT_SALT_MAX if cfg.auth.enabled else SALT_MAX
    return RouterState(cfg, conductor, tokenizer, RouterMetrics(conductor),
                       Authenticator(cfg.auth), limits.InFlight(cfg.limits),
                       api_models.completion_model(cfg.model, cfg.limits, tokenizer.vocab_size,
                                                   salt_max),
                       api_models.chat_model(cfg.model, cfg.limits, salt_max), transport)


def build_app(cfg: RouterConfig, **kwargs: Any) -> FastAPI:
    """The router app for ``cfg``; ``kwargs`` go to :func:`build_state`."""
    state = build_state(cfg, **kwargs)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        up = cfg.upstream
        state.client = httpx.AsyncClient(
            transport=state.transport, limits=httpx.Limits(max_connections=1024),
            timeout=httpx.Timeout(up.timeout_s, connect=up.connect_timeout_s))
        state.proxy = Proxy(state.conductor, state.client, state.metrics)
        state.zmq_ctx = zmq.asyncio.Context()
        for spec in cfg.instances:
            state.add_instance(spec)
        loop = asyncio.get_running_loop()
        state.tasks["health"] = loop.create_task(state.health_loop())
        if cfg.replication.enabled:
            state.replicator = Replicator(state.conductor, state.metrics, state.client)
            state.tasks["replication"] = loop.create_task(state.replicator.run())
        try:
            yield
        finally:
            if state.replicator is not None:
                await state.replicator.close()
            for task in state.tasks.values():
                task.cancel()
            await asyncio.gather(*state.tasks.values(), return_exceptions=True)
            await state.client.aclose()
            for inst in state.conductor.registry:  # a listener whose task was cancelled
                if inst.listener is not None:      # before its first step never closed
                    inst.listener.close()          # its socket, and term() would wait on it
            state.zmq_ctx.term()
            state.conductor.store.close()

    app = FastAPI(title="kvcentric router", lifespan=lifespan)
    app.state.router = state
    schema = build_openapi(cfg, state.completion_model, state.chat_model)
    app.openapi = lambda: schema  # type: ignore[method-assign]
    _openai_routes(app, state)
    _admin_routes(app, state)
    dashboard_routes(app, state)
    return app


def _parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Refused(400, f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise Refused(400, "the body must be a JSON object")
    return body


async def _json_body(request: Request, max_bytes: int) -> dict[str, Any]:
    return _parse_json(await limits.read_body(request.stream(), request.headers, max_bytes))


def _released(resp: Response, release: Any) -> Response:
    """``resp`` with ``release()`` called once its body has been sent (or now)."""
    if not isinstance(resp, StreamingResponse):
        release()
        return resp
    inner = resp.body_iterator

    async def body() -> AsyncIterator[Any]:
        try:
            async for chunk in inner:
                yield chunk
        finally:
            release()

    resp.body_iterator = body()
    return resp


def _openai_routes(app: FastAPI, state: RouterState) -> None:
    cfg = state.cfg

    async def openai(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            caller = state.auth.caller(request.headers)
            body, tokens = await _admit(request, chat)
            state.inflight.acquire(caller.budget)
        except Refused as refused:
            resp: Response = refused.response()
        else:
            try:
                resp = await _forward(request, chat, caller, body, tokens)
            except BaseException:
                state.inflight.release(caller.budget)
                raise
            resp = _released(resp, lambda: state.inflight.release(caller.budget))
        state.metrics.requests.labels(endpoint, str(resp.status_code)).inc()
        return resp

    async def _admit(request: Request, chat: bool) -> tuple[dict[str, Any], np.ndarray]:
        """The parsed body and prompt tokens, or :class:`Refused` (400/404/413)."""
        body = await _json_body(request, cfg.limits.max_body_bytes)
        model = body.get("model", cfg.model)
        if model != cfg.model:
            raise Refused(404, f"model {model!r} does not exist; this router serves "
                          f"{cfg.model!r}")
        body = api_models.validate(state.chat_model if chat else state.completion_model, body)
        api_models.normalize(body, cfg.limits)
        try:
            encode = state.tokenizer.chat_ids if chat else state.tokenizer.completion_ids
            tokens = await asyncio.to_thread(encode, body)
        except ValueError as exc:
            raise Refused(400, str(exc)) from exc
        limits.check_prompt(len(tokens), cfg.limits)
        return body, tokens

    async def _forward(request: Request, chat: bool, caller: Caller, body: dict[str, Any],
                       tokens: np.ndarray) -> Response:
        salt = state.auth.salt(caller, body.get("cache_salt"))
        if salt is not None:
            body["cache_salt"] = salt  # the engines hash it into every block of the prompt
        hashes = state.conductor.hashes(tokens, salt)
        tail = state.conductor.tail(tokens, hashes, salt)
        if state.replicator is not None:
            state.replicator.observe(hashes, tokens, salt)
        # a router key is the router's business: never forwarded to the engines, which get
        # upstream.api_key when they check keys of their own
        forwarded = ("content-type", "accept", "x-request-id") if state.auth.enabled else \
            ("authorization", "content-type", "accept", "x-request-id")
        headers = {k: v for k, v in request.headers.items() if k.lower() in forwarded}
        if cfg.upstream.api_key:
            headers["authorization"] = f"Bearer {cfg.upstream.api_key}"
        assert state.proxy is not None
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return await state.proxy.handle(path, body, hashes, len(tokens), headers, tail)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        try:
            state.auth.caller(request.headers)
        except Refused as refused:
            return refused.response()
        return JSONResponse({"object": "list", "data": [
            {"id": cfg.model, "object": "model", "owned_by": "kvcentric", "created": 0,
             "root": cfg.tokenizer}]})



def _admin_routes(app: FastAPI, state: RouterState) -> None:
    cfg = state.cfg

    @app.get("/health")
    async def health() -> JSONResponse:
        reg = state.conductor.registry
        pre = len(reg.candidates(cfg.model, prefill=True))
        dec = len(reg.candidates(cfg.model, prefill=False))
        ok = pre > 0 and dec > 0
        return JSONResponse({"status": "ok" if ok else "unavailable", "prefill": pre,
                             "decode": dec, "instances": len(reg)},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.api_route("/instances", methods=["GET", "POST"])
    async def instances(request: Request) -> JSONResponse:
        # one route for both methods: a 405 then names both in its Allow header
        try:
            state.auth.check_admin(request.headers)
            if request.method == "POST":
                return await _add_instance(request)
        except Refused as refused:
            return refused.response()
        now = time.monotonic()
        c = state.conductor
        return JSONResponse({"instances": [i.describe(c.index, now) for i in c.registry],
                             "keys": {"block_size": c.block_size,
                                      "model_id": cfg.model_id,
                                      "layout_sig": c.store.layout_sig},
                             "store": {"enabled": c.store.enabled, "queries": c.store.queries,
                                       "errors": c.store.errors}})

    async def _add_instance(request: Request) -> JSONResponse:
        spec = None
        try:
            spec = InstanceSpec.from_dict(await _json_body(request, cfg.limits.max_body_bytes))
            inst = await state.add_instance_rebinding(spec)
        except ValueError as exc:
            return error_response(400, str(exc))
        except KeyError as exc:
            return error_response(409, str(exc.args[0]))
        except zmq.ZMQError as exc:  # a well-formed address this host cannot take
            assert spec is not None
            return error_response(409, f"cannot listen on {spec.kv_events}: {exc}")
        return JSONResponse(inst.describe(state.conductor.index, time.monotonic()),
                            status_code=201)

    @app.delete("/instances/{name}")
    async def delete_instance(name: str, request: Request) -> JSONResponse:
        try:
            state.auth.check_admin(request.headers)
        except Refused as refused:
            return refused.response()
        if state.conductor.registry.get(name) is None:
            return error_response(404, f"no instance {name!r}")
        inst = state.remove_instance(name)
        return JSONResponse({"removed": inst.name})
