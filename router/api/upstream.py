"""HTTP clients to the engines: one connection pool per engine.

One ``httpx.AsyncClient`` for a whole fleet keeps every engine's connections in one pool,
and httpcore walks that pool on every request and every response (``is_idle``,
``has_expired``, which polls each idle socket): its cost grows with the fleet. Profiled
with 64 emulated engines at 22 requests/s, that walk and its socket polls took as much of
the router's event loop as tokenising, and requests queued in the router for seconds.
:class:`Upstreams` gives each engine (scheme, host and port) a client of its own, made on
first use, so a request touches only its engine's few connections.

It offers the calls the router makes (``get``, ``post``, ``build_request``, ``send``,
``aclose``) with ``httpx.AsyncClient``'s signatures. Runs on the router's event loop.
"""

from __future__ import annotations

import ssl
from typing import Any

import httpx

KEEPALIVE_PER_ENGINE = 64
CONNECTIONS_PER_ENGINE = 512


class Upstreams:
    """Per-engine ``httpx.AsyncClient``s sharing one timeout, one transport (tests inject
    a mock one) and limits per engine."""

    def __init__(self, timeout: httpx.Timeout,
                 transport: httpx.AsyncBaseTransport | None = None,
                 limits: httpx.Limits | None = None) -> None:
        self.timeout = timeout
        self.transport = transport
        self.limits = limits or httpx.Limits(max_connections=CONNECTIONS_PER_ENGINE,
                                             max_keepalive_connections=KEEPALIVE_PER_ENGINE)
        self._clients: dict[tuple[bytes, bytes, int | None], httpx.AsyncClient] = {}
        # one TLS context for all: building one loads the CA bundle (~25 ms of CPU and
        # about a MiB each, per engine at 64 engines otherwise)
        self._tls: ssl.SSLContext | None = None

    def client(self, url: httpx.URL | str) -> httpx.AsyncClient:
        """The client of the engine ``url`` points at."""
        u = url if isinstance(url, httpx.URL) else httpx.URL(url)
        key = (u.raw_scheme, u.raw_host, u.port)
        c = self._clients.get(key)
        if c is None:
            if self._tls is None:
                self._tls = httpx.create_ssl_context()
            c = httpx.AsyncClient(transport=self.transport, limits=self.limits,
                                  timeout=self.timeout, verify=self._tls)
            self._clients[key] = c
        return c

    def __len__(self) -> int:
        return len(self._clients)

    async def forget(self, url: str) -> None:
        """Close and drop the client of a removed engine."""
        u = httpx.URL(url)
        c = self._clients.pop((u.raw_scheme, u.raw_host, u.port), None)
        if c is not None:
            await c.aclose()

    async def get(self, url: str, **kw: Any) -> httpx.Response:
        return await self.client(url).get(url, **kw)

    async def post(self, url: str, **kw: Any) -> httpx.Response:
        return await self.client(url).post(url, **kw)

    def build_request(self, method: str, url: str, **kw: Any) -> httpx.Request:
        return self.client(url).build_request(method, url, **kw)

    async def send(self, request: httpx.Request, **kw: Any) -> httpx.Response:
        return await self.client(request.url).send(request, **kw)

    async def aclose(self) -> None:
        clients = list(self._clients.values())
        self._clients.clear()
        for c in clients:
            await c.aclose()
