"""The router's FastAPI app: its state, and the wiring of its endpoints.

``build_app(cfg)`` wires everything; nothing runs at import. The lifespan starts the
upstream HTTP client, one KV event listener per instance that publishes events, checks
every configured instance once (an instance takes traffic only once a check passed), then
runs the health/metrics poll loop, and stops them on shutdown.

Endpoints: the OpenAI front (:mod:`kvcentric.router.api.openai_routes`: ``POST
/v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``), the operator's
(:mod:`kvcentric.router.api.admin_routes`: ``GET /health``, ``GET /metrics``, ``GET/POST
/instances``, ``DELETE /instances/{name}``), Mooncake's Conductor indexer API
(:mod:`kvcentric.router.api.indexer_routes`: ``POST /register``, ``/unregister``, ``/query``,
``/query_by_hash``, ``GET /services``, ``/global_view``), ``GET /dashboard``
(:mod:`kvcentric.router.ops.dashboard`) and ``GET /openapi.json``
(:mod:`kvcentric.router.api.openapi`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx
import zmq.asyncio
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.responses import HTMLResponse

from kvcentric.router.api import api_models, limits
from kvcentric.router.api.admin_routes import admin_routes
from kvcentric.router.api.auth import CLIENT_SALT_MAX, SALT_MAX, Authenticator
from kvcentric.router.api.indexer_routes import StandardIndexer, indexer_routes
from kvcentric.router.api.openai_routes import openai_routes
from kvcentric.router.api.openapi import build_openapi, docs_page
from kvcentric.router.api.proxy import Proxy
from kvcentric.router.api.upstream import Upstreams
from kvcentric.router.conductor import Conductor
from kvcentric.router.config import RouterConfig
from kvcentric.router.cost.cost_model import Profile, kv_bytes_per_token
from kvcentric.router.fleet import instances as inst_mod
from kvcentric.router.fleet.instance_spec import InstanceSpec
from kvcentric.router.fleet.instances import Instance
from kvcentric.router.fleet.kv_events import (
    EventListener,
    EventTranslator,
    apply_events,
    router_binds,
)
from kvcentric.router.fleet.peers import PeerSync
from kvcentric.router.fleet.replication import Replicator
from kvcentric.router.fleet.store_events import StoreFeed
from kvcentric.router.fleet.store_view import StoreView
from kvcentric.router.ops.dashboard import dashboard_routes
from kvcentric.router.ops.memory import HeapTrimmer, limit_arenas
from kvcentric.router.ops.metrics import RouterMetrics
from kvcentric.router.tokenize import PromptTokenizer
from kvcentric.stored_layout import stored_block_size

# ZMQ closes a removed instance's event socket on its I/O thread, a moment after the
# DELETE answers: re-adding the instance at once could find its port still bound (seen in
# a full test run under load: DELETE then POST of the same instance, 409). A bind refused
# as in use is retried for this long before the POST answers 409.
REBIND_WAIT_S = 2.0

log = logging.getLogger("router.api.app")


@dataclass
class RouterState:
    cfg: RouterConfig
    conductor: Conductor
    tokenizer: PromptTokenizer
    metrics: RouterMetrics
    auth: Authenticator
    inflight: limits.InFlight
    bounds: limits.Bounds
    completion_model: type[BaseModel]
    chat_model: type[BaseModel]
    indexer: StandardIndexer
    transport: httpx.AsyncBaseTransport | None = None
    proxy: Proxy | None = None
    replicator: Replicator | None = None
    client: Upstreams | None = None
    zmq_ctx: zmq.asyncio.Context | None = None
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    store_listener: EventListener | None = None  # the store's KV events (store_events)
    # (instance, page size) pairs already warned about a pinned keys.block_size
    block_size_warned: set[tuple[str, int]] = field(default_factory=set)

    def context(self) -> int:
        """The context requests are held to now: the smallest the healthy engines report
        (``/v1/models``), at most the configured one."""
        return self.bounds.context(i.max_model_len for i in self.conductor.registry
                                   if i.healthy and i.max_model_len)

    # ---- instances ----
    def add_instance(self, spec: InstanceSpec) -> Instance:
        """Register ``spec``, out of rotation until :meth:`check_instance` passes, and
        start its event listener; a listener that cannot be made (``zmq.ZMQError``: an
        address this host cannot take) leaves nothing registered."""
        inst = self.conductor.registry.add(spec, healthy=False)
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
            apply_events(tr, index, slot, events)

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
        inst = self.conductor.registry.remove(name)  # closes the socket now: port reusable
        if self.client is not None and not any(i.spec.url == inst.spec.url
                                                for i in self.conductor.registry):
            forget = asyncio.get_running_loop().create_task(self.client.forget(inst.spec.url))
            self.tasks[f"forget:{name}:{id(forget)}"] = forget
            forget.add_done_callback(lambda t: self.tasks.pop(f"forget:{name}:{id(t)}", None))
        return inst

    async def check_instance(self, inst: Instance) -> None:
        """One health check of ``inst`` (it enters rotation when it passes)."""
        assert self.client is not None
        await inst_mod.check(inst, self.conductor.registry, self.client, self.cfg.health,
                             self.cfg.upstream.api_key)

    async def check_all(self) -> None:
        """One health check of every instance, then what the engines' reports settle."""
        c = self.conductor
        await asyncio.gather(*(self.check_instance(i) for i in c.registry))
        if c.block_size is None:
            page = next((i.stats.page_size for i in c.registry if i.stats.page_size), None)
            if page:  # the connector's own default for this page size
                c.set_block_size(stored_block_size(page))
        elif self.cfg.keys.block_size is not None:
            self._check_block_size(self.cfg.keys.block_size)
        if c.block_size is not None:
            for i in c.registry:
                inst_mod.fit_capacity(i, c.index, c.block_size)

    def _check_block_size(self, pinned: int) -> None:
        """Warn, once per instance, when the pinned ``keys.block_size`` cannot be what an
        instance stores: not a multiple of its page (no connector can store such blocks),
        or not the connector's default for its page (right only if the engine's connector
        sets that ``block_size`` itself, which its ``/metrics`` do not show). Either way
        the router's store lookups name blocks nobody stored and never match."""
        for i in self.conductor.registry:
            page = i.stats.page_size
            if not page or (i.name, page) in self.block_size_warned:
                continue
            default = stored_block_size(page)
            if pinned % page:
                why = (f"is not a multiple of the engine's page of {page} tokens: no "
                       "connector stores such blocks")
            elif pinned != default:
                why = (f"differs from the {default}-token blocks the connector stores by "
                       f"default for the engine's page of {page} tokens (right only if its "
                       f"kv_connector_extra_config sets block_size: {pinned})")
            else:
                continue
            self.block_size_warned.add((i.name, page))
            log.warning("keys.block_size %d %s: instance %s (%s); store lookups match only "
                        "blocks of the size the engines store (keys.block_size: null takes "
                        "the connector's default)", pinned, why, i.name, i.spec.url)

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health.interval_s)
            await self.check_all()


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
    se = cfg.store_events
    feed = (StoreFeed(cfg.model_id, cfg.keys.layout_sig, cfg.keys.tp_size, se.max_keys)
            if se.enabled else None)
    store = StoreView(cfg.store, cfg.model_id, layout_sig=cfg.keys.layout_sig, feed=feed,
                      tp_size=cfg.keys.tp_size, ttl_s=cfg.cache.store_ttl_s,
                      negative_ttl_s=cfg.cache.store_negative_ttl_s)
    conductor = Conductor(cfg, profile, kvb, store)
    tokenizer = tokenizer or PromptTokenizer(cfg.tokenizer, cfg.cache.prompt_text_chars)
    bounds = limits.Bounds.resolve(
        cfg.limits, model_len=limits.model_context(cfg.tokenizer),
        vocab_size=tokenizer.vocab_size, max_chars_per_token=tokenizer.max_chars_per_token,
        template_kwargs=tokenizer.template_kwargs(cfg.limits.chat_template_kwargs),
        salt_max=CLIENT_SALT_MAX if cfg.auth.enabled else SALT_MAX)
    return RouterState(cfg, conductor, tokenizer, RouterMetrics(conductor, tokenizer),
                       Authenticator(cfg.auth),
                       limits.InFlight(cfg.limits, lambda: len(conductor.registry)), bounds,
                       api_models.completion_model(cfg.model, bounds),
                       api_models.chat_model(cfg.model, bounds),
                       StandardIndexer(cfg.indexer), transport)


def build_app(cfg: RouterConfig, **kwargs: Any) -> FastAPI:
    """The router app for ``cfg``; ``kwargs`` go to :func:`build_state`."""
    state = build_state(cfg, **kwargs)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if cfg.memory.malloc_arenas:  # before any worker thread allocates
            limit_arenas(cfg.memory.malloc_arenas)
        up = cfg.upstream
        state.client = Upstreams(httpx.Timeout(up.timeout_s, connect=up.connect_timeout_s),
                                 state.transport)
        state.proxy = Proxy(state.conductor, state.client, state.metrics)
        state.zmq_ctx = zmq.asyncio.Context()
        feed = state.conductor.store.feed
        if feed is not None:
            se = cfg.store_events
            assert se.endpoint is not None
            state.store_listener = EventListener(state.zmq_ctx, se.endpoint, feed.on_events,
                                                 bind=False, replay=se.replay_endpoint)
            state.tasks["store-events"] = asyncio.get_running_loop().create_task(
                state.store_listener.run())
        for spec in cfg.instances:
            state.add_instance(spec)
        await state.check_all()  # instances enter rotation here, or when they answer
        loop = asyncio.get_running_loop()
        state.tasks["health"] = loop.create_task(state.health_loop())
        if cfg.replication.enabled:
            state.replicator = Replicator(state.conductor, state.metrics, state.client)
            state.tasks["replication"] = loop.create_task(state.replicator.run())
        if cfg.memory.trim_interval_s:
            trimmer = HeapTrimmer(cfg.memory.trim_interval_s, state.metrics.heap_released.inc)
            state.tasks["trim"] = loop.create_task(trimmer.run())
        if cfg.peers.enabled:
            peers = PeerSync(state.zmq_ctx, state.conductor, cfg.peers.publish,
                             cfg.peers.connect)
            state.conductor.peers = peers
            state.tasks["peers"] = loop.create_task(peers.run())
        try:
            yield
        finally:
            if state.replicator is not None:
                await state.replicator.close()
            for task in state.tasks.values():
                task.cancel()
            await asyncio.gather(*state.tasks.values(), return_exceptions=True)
            await state.client.aclose()
            if state.conductor.peers is not None:
                state.conductor.peers.close()
                state.conductor.peers = None
            for inst in state.conductor.registry:  # a listener whose task was cancelled
                if inst.listener is not None:      # before its first step never closed
                    inst.listener.close()          # its socket, and term() would wait on it
            state.indexer.close()
            if state.store_listener is not None:
                state.store_listener.close()
            state.zmq_ctx.term()
            state.conductor.store.close()

    # no Swagger UI or ReDoc from a CDN: /docs is a page of our own (openapi.docs_page)
    app = FastAPI(title="kvcentric router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = state
    schema = build_openapi(cfg, state.completion_model, state.chat_model)
    app.openapi = lambda: schema  # type: ignore[method-assign]
    page = docs_page(schema)
    for path in ("/docs", "/redoc"):
        app.add_api_route(path, lambda: HTMLResponse(page), methods=["GET"],
                          include_in_schema=False)
    openai_routes(app, state)
    admin_routes(app, state)
    dashboard_routes(app, state)
    indexer_routes(app, state)
    return app


