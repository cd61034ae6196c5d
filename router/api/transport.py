"""An ``httpx`` transport over aiohttp's client: the router's wire to one engine.

httpx's own transport (httpcore over h11) parses HTTP in pure Python; the router relays
every engine response through it, and per streamed request it cost about as much CPU as
the rest of the router's forwarding. aiohttp parses with llhttp (C). :class:`AiohttpTransport`
keeps httpx's types on both sides: :class:`~kvcentric.router.api.upstream.Upstreams` builds
``httpx.Request``s and gets ``httpx.Response``s whose stream reads aiohttp's, and every
failure is raised as the ``httpx`` exception the proxy already tells apart (a connect
error may retry elsewhere, a read timeout may not). Tests inject ``httpx.MockTransport``
in its place.

Runs on the router's event loop; the aiohttp session is made on the first request (it
belongs to the loop it was made on) and closed by :meth:`AiohttpTransport.aclose`.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
from yarl import URL

# under uvicorn's 5 s keep-alive (vLLM's and SGLang's servers): the router drops an idle
# connection before the engine does, so a request is never written to a connection the
# engine is closing at that moment
KEEPALIVE_S = 4.0


def mapped(exc: BaseException, request: httpx.Request) -> httpx.TransportError:
    """The ``httpx`` exception for an aiohttp failure: connect errors and timeouts as
    ``ConnectError``/``ConnectTimeout`` (the engine was not reached), read timeouts as
    ``ReadTimeout`` (it may still be working), a broken connection or message as
    ``RemoteProtocolError``/``ReadError``; a URL that cannot be connected to (its host
    fails IDNA encoding, say) as ``ConnectError``."""
    text = str(exc) or type(exc).__name__
    kind: type[httpx.TransportError]
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        kind = httpx.ConnectTimeout
    elif isinstance(exc, (aiohttp.ClientConnectorError, ValueError)):
        kind = httpx.ConnectError  # ValueError: a host no resolver takes (``a..b``, ``0``)
    elif isinstance(exc, (aiohttp.SocketTimeoutError, aiohttp.ServerTimeoutError,
                          TimeoutError)):
        kind = httpx.ReadTimeout
    elif isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError,
                          aiohttp.ClientResponseError)):
        kind = httpx.RemoteProtocolError
    else:
        kind = httpx.ReadError
    return kind(text, request=request)


class _Body(httpx.AsyncByteStream):
    """An aiohttp response's body as httpx reads it: chunks as they arrive, undecoded.
    Closing it before the end closes the connection (the engine sees the client leave);
    after the end the connection goes back to the pool."""

    def __init__(self, resp: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._resp = resp
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise mapped(exc, self._request) from exc

    async def aclose(self) -> None:
        if self._resp.content.at_eof():
            self._resp.release()
        else:
            self._resp.close()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """Requests to one engine over an aiohttp connection pool of ``connections``
    connections (idle ones kept :data:`KEEPALIVE_S`). Timeouts come from each request's
    ``timeout`` extension, as httpx's transports read them: ``connect`` bounds the TCP
    (and TLS) connect, ``pool`` the wait for a pooled connection plus the connect,
    ``read`` each read of the response (headers, then every chunk), and ``write`` plus
    ``read`` the whole wait from sending the request to its response's head. Bodies are relayed as
    sent (no ``Accept-Encoding`` is added, nothing is decompressed); no cookies are kept
    and no proxy from the environment is used."""

    def __init__(self, connections: int, tls: ssl.SSLContext | None = None) -> None:
        self.connections = connections
        self.tls = tls
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[tuple[Any, ...], aiohttp.ClientTimeout] = {}

    def _open(self) -> aiohttp.ClientSession:
        conn = aiohttp.TCPConnector(limit=self.connections, limit_per_host=0,
                                    keepalive_timeout=KEEPALIVE_S,
                                    ssl=self.tls if self.tls is not None else True)
        self._session = aiohttp.ClientSession(
            connector=conn, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    def _timeout(self, ext: dict[str, float | None] | None) -> aiohttp.ClientTimeout:
        ext = ext or {}
        key = (ext.get("connect"), ext.get("read"), ext.get("pool"))
        t = self._timeouts.get(key)
        if t is None:
            connect, read, pool = key
            whole = None if pool is None or connect is None else pool + connect
            t = aiohttp.ClientTimeout(total=None, connect=whole, sock_connect=connect,
                                      sock_read=read)
            self._timeouts[key] = t
        return t

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        session = self._session or self._open()
        body = request.content if isinstance(request.stream, httpx.ByteStream) \
            else await request.aread()
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
        timeouts = request.extensions.get("timeout") or {}
        write, read = timeouts.get("write"), timeouts.get("read")
        try:
            # aiohttp bounds no write: an engine that stopped reading (SIGSTOP) with a
            # body larger than the socket buffers would hold the request for ever
            async with asyncio.timeout(None if write is None or read is None
                                       else write + read):
                resp = await session.request(
                    request.method, URL(str(request.url), encoded=True), data=body or None,
                    headers=headers, timeout=self._timeout(timeouts), allow_redirects=False)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise mapped(exc, request) from exc
        return httpx.Response(resp.status, headers=list(resp.raw_headers),
                              stream=_Body(resp, request), request=request,
                              extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
