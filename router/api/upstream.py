"""HTTP clients to the engines: one connection pool per engine.

One pool for a whole fleet made httpcore walk every engine's idle connections on every
request and response (``is_idle``, ``has_expired``, which polls each idle socket): its
cost grew with the fleet. :class:`Upstreams` gives each engine (scheme, host and port) a
transport of its own (:class:`~kvcentric.router.api.transport.AiohttpTransport`), made on
first use, so a request touches only its engine's few connections.

It offers the calls the router makes (``get``, ``post``, ``build_request``, ``send``,
``aclose``) with ``httpx.AsyncClient``'s signatures and types, and calls the transport
directly: the client layer's per-request work (cookies, auth, redirects, event hooks)
is nothing the router uses, and it cost as much CPU per streamed request as the HTTP
parsing. Redirects are not followed and the environment's proxies are not used. Runs on
the router's event loop.
"""

from __future__ import annotations

import logging
import ssl
from typing import Any

import httpx

from kvcentric.router.api.transport import AiohttpTransport

CONNECTIONS_PER_ENGINE = 512

log = logging.getLogger(__name__)


class Upstreams:
    """Per-engine transports sharing one default timeout and one TLS context, at most
    ``connections`` connections each; ``transport``, when given (tests inject an
    ``httpx.MockTransport``), serves every engine instead."""

    def __init__(self, timeout: httpx.Timeout,
                 transport: httpx.AsyncBaseTransport | None = None,
                 connections: int = CONNECTIONS_PER_ENGINE) -> None:
        self.timeout = timeout
        self.transport = transport
        self.connections = connections
        self._transports: dict[tuple[bytes, bytes, int | None], AiohttpTransport] = {}
        # one TLS context for all: building one loads the CA bundle (~25 ms of CPU and
        # about a MiB each, per engine at 64 engines otherwise)
        self._tls: ssl.SSLContext | None = None

    def _key(self, u: httpx.URL) -> tuple[bytes, bytes, int | None]:
        return u.raw_scheme, u.raw_host, u.port

    def transport_for(self, url: httpx.URL) -> httpx.AsyncBaseTransport:
        """The transport of the engine ``url`` points at."""
        if self.transport is not None:
            return self.transport
        key = self._key(url)
        t = self._transports.get(key)
        if t is None:
            if url.scheme == "https" and self._tls is None:
                self._tls = httpx.create_ssl_context()
            t = AiohttpTransport(self.connections, self._tls if url.scheme == "https" else None)
            self._transports[key] = t
        return t

    def __len__(self) -> int:
        return len(self._transports)

    async def forget(self, url: str) -> None:
        """Close and drop the connections of a removed engine."""
        t = self._transports.pop(self._key(httpx.URL(url)), None)
        if t is not None:
            await t.aclose()

    def build_request(self, method: str, url: str, *, content: bytes | None = None,
                      json: Any = None, headers: dict[str, str] | None = None,
                      timeout: float | None = None) -> httpx.Request:
        """A request to ``url``; ``timeout`` (seconds, every phase) overrides the
        default for this request."""
        t = self.timeout if timeout is None else httpx.Timeout(timeout)
        return httpx.Request(method, url, content=content, json=json, headers=headers,
                             extensions={"timeout": t.as_dict()})

    async def send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        """``request``'s response: its head only with ``stream`` (the caller reads the
        body and closes it), else read whole and closed. Raises ``httpx.TransportError``s."""
        resp = await self.transport_for(request.url).handle_async_request(request)
        resp.request = request
        if log.isEnabledFor(logging.DEBUG):  # health polls: several a second per engine
            log.debug("upstream %s %s: HTTP %d", request.method, request.url, resp.status_code)
        if not stream:
            try:
                await resp.aread()
            finally:
                await resp.aclose()
        return resp

    async def get(self, url: str, **kw: Any) -> httpx.Response:
        return await self.send(self.build_request("GET", url, **kw))

    async def post(self, url: str, **kw: Any) -> httpx.Response:
        return await self.send(self.build_request("POST", url, **kw))

    async def aclose(self) -> None:
        transports = list(self._transports.values())
        self._transports.clear()
        for t in transports:
            await t.aclose()
        if self.transport is not None:
            await self.transport.aclose()
