"""The router's wire to its engines (:mod:`kvcentric.router.api.transport`, through
:class:`~kvcentric.router.api.upstream.Upstreams`) against a real HTTP server on
loopback, each fault mounted for real: a stream arrives chunk by chunk as sent, one
connection serves request after request, a client that stops reading closes the
connection (so vLLM aborts), bodies pass undecoded, and every failure is the ``httpx``
exception the proxy tells apart (refused: ``ConnectError``, the engine reached and
silent: ``ReadTimeout``, a message cut short: ``RemoteProtocolError``). The server is
asyncio's own, on the test's loop: every wait is on an event, bounded by ``WAIT_S``."""

from __future__ import annotations

import asyncio
import gzip
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import httpx
import pytest

from kvcentric.router.api.transport import AiohttpTransport, mapped
from kvcentric.router.api.upstream import Upstreams

WAIT_S = 30.0
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]
Test = Callable[[str, "Server", Upstreams], Awaitable[None]]


@dataclass
class Server:
    """A loopback HTTP/1.1 server whose every connection runs ``handler``; it counts
    connections and keeps what it read."""

    handler: Handler
    connections: int = 0
    heads: list[bytes] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    go_on: asyncio.Event = field(default_factory=asyncio.Event)

    async def read_request(self, r: asyncio.StreamReader) -> bool:
        """One request read; False at a clean end of the connection."""
        try:
            head = await r.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        n = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                n = int(value)
        self.heads.append(head)
        self.bodies.append(await r.readexactly(n))
        return True

    async def serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(r, w, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.closed.set()
            w.close()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
               b"transfer-encoding: chunked\r\n\r\n")


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def answering(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
    """Answers every request on the connection with its own body."""
    while await s.read_request(r):
        w.write(ok(s.bodies[-1] or b"empty"))
        await w.drain()


def run(handler: Handler, test: Test,
        timeout: httpx.Timeout | None = None) -> Server:
    """``test(base_url, server, upstreams)`` on one loop with the server listening."""
    async def go() -> Server:
        s = Server(handler)
        srv = await asyncio.start_server(s.serve, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        ups = Upstreams(timeout or httpx.Timeout(WAIT_S))
        try:
            await asyncio.wait_for(test(f"http://127.0.0.1:{port}", s, ups), WAIT_S)
        finally:
            await ups.aclose()
            srv.close()
            await srv.wait_closed()
        return s
    return asyncio.run(go())


def posting_raises(kind: type[httpx.TransportError]) -> Test:
    """A test: a POST to the server raises ``kind``."""
    async def test(url: str, s: Server, ups: Upstreams) -> None:
        with pytest.raises(kind):
            await ups.post(url + "/v1/completions", content=b"{}")
    return test


def streaming_raises(kind: type[httpx.TransportError]) -> Test:
    """A test: a streamed POST gets its head, then reading the body raises ``kind``."""
    async def test(url: str, s: Server, ups: Upstreams) -> None:
        resp = await ups.send(ups.build_request("POST", url + "/x", content=b"{}"),
                              stream=True)
        with pytest.raises(kind):
            async for _ in resp.aiter_raw():
                pass
        await resp.aclose()
    return test


def test_a_stream_arrives_chunk_by_chunk_and_bytes_untouched() -> None:
    events = [b'data: {"t": 1}\n\n', b'data: {"t": 2}\n\n', b"data: [DONE]\n\n"]

    async def stream(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await s.read_request(r)
        w.write(STREAM_HEAD + chunk(events[0]))
        await w.drain()
        await s.go_on.wait()  # the rest only once the client holds the first event
        w.write(chunk(events[1]) + chunk(events[2]) + b"0\r\n\r\n")
        await w.drain()
        await s.read_request(r)

    async def test(url: str, s: Server, ups: Upstreams) -> None:
        req = ups.build_request("POST", url + "/v1/completions", content=b'{"prompt": "x"}',
                                headers={"content-type": "application/json"})
        resp = await ups.send(req, stream=True)
        assert resp.status_code == 200 and resp.headers["content-type"] == "text/event-stream"
        it = resp.aiter_raw()
        got = [await it.__anext__()]
        assert got == [events[0]]
        s.go_on.set()
        got += [c async for c in it]
        assert b"".join(got) == b"".join(events)
        assert resp.is_closed

    s = run(stream, test)
    head = s.heads[0].lower()
    assert s.bodies == [b'{"prompt": "x"}']
    assert b"content-type: application/json" in head and b"host: 127.0.0.1" in head
    assert b"accept-encoding" not in head  # the engine is not asked to compress a relay


def test_one_connection_serves_request_after_request() -> None:
    async def test(url: str, s: Server, ups: Upstreams) -> None:
        for i in range(5):
            r = await ups.post(url + "/v1/completions", content=b"n%d" % i)
            assert r.status_code == 200 and r.content == b"n%d" % i
        r = await ups.get(url + "/health")
        assert r.content == b"empty"

    s = run(answering, test)
    assert s.connections == 1 and len(s.bodies) == 6


def test_a_reader_that_stops_early_closes_the_connection() -> None:
    async def endless(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await s.read_request(r)
        w.write(STREAM_HEAD)
        while True:  # a decode that goes on until the client leaves
            w.write(chunk(b"data: {}\n\n"))
            await w.drain()
            await asyncio.sleep(0.001)

    async def test(url: str, s: Server, ups: Upstreams) -> None:
        resp = await ups.send(ups.build_request("POST", url + "/v1/completions",
                                                content=b"{}"), stream=True)
        it = resp.aiter_raw()
        await it.__anext__()
        await resp.aclose()
        await s.closed.wait()  # the engine saw its client leave

    run(endless, test)


def test_a_json_body_and_a_compressed_answer_read_whole() -> None:
    packed = gzip.compress(b'{"ok": true}')

    async def gz(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await s.read_request(r)
        w.write(ok(packed, b"content-encoding: gzip\r\ncontent-type: application/json\r\n"))
        await w.drain()

    async def test(url: str, s: Server, ups: Upstreams) -> None:
        r = await ups.post(url + "/v1/completions", json={"prompt": "x"})
        assert r.json() == {"ok": True}  # decoded once, by httpx

    s = run(gz, test)
    assert s.bodies == [b'{"prompt":"x"}']


def test_a_refused_connection_is_a_connect_error() -> None:
    with socket.socket() as sock:  # a port nobody listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

        async def test(url: str, s: Server, ups: Upstreams) -> None:
            with pytest.raises(httpx.ConnectError):
                await ups.post(f"http://127.0.0.1:{port}/v1/completions", content=b"{}")

        run(answering, test)


@pytest.mark.parametrize("host", ["a..b", "0", "-x-.example"])
def test_a_host_no_connection_can_reach_is_a_connect_error(host: str) -> None:
    """Hosts an admin may register (the router's schema takes any string): each fails
    before anything is sent, as a connect error, never as an exception of its own."""
    async def test(url: str, s: Server, ups: Upstreams) -> None:
        with pytest.raises(httpx.ConnectError):
            await ups.get(f"http://{host}:65000/health")

    run(answering, test)


def test_an_engine_that_never_answers_is_a_read_timeout() -> None:
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await s.read_request(r)
        await s.go_on.wait()  # never set: the connection is held open

    async def mid_stream(r: asyncio.StreamReader, w: asyncio.StreamWriter,
                         s: Server) -> None:
        await s.read_request(r)
        w.write(STREAM_HEAD + chunk(b"data: {}\n\n"))
        await w.drain()
        await s.go_on.wait()

    quick = httpx.Timeout(0.3, connect=WAIT_S)
    run(silent, posting_raises(httpx.ReadTimeout), quick)
    run(mid_stream, streaming_raises(httpx.ReadTimeout), quick)


def test_an_engine_that_stops_reading_a_large_body_is_a_timeout() -> None:
    """A stopped engine (SIGSTOP) still accepts connections; once the socket buffers are
    full, sending the rest of a large prompt waits: that wait is bounded as well."""
    async def deaf(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await s.go_on.wait()  # reads nothing: its buffers fill

    async def test(url: str, s: Server, ups: Upstreams) -> None:
        with pytest.raises(httpx.ReadTimeout):
            await ups.post(url + "/v1/completions", content=b"x" * (64 << 20))

    run(deaf, test, httpx.Timeout(0.3, connect=WAIT_S))


def test_a_message_cut_short_is_a_protocol_error() -> None:
    async def hangs_up(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await s.read_request(r)  # and closes without a word

    async def cut(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await s.read_request(r)
        w.write(STREAM_HEAD + chunk(b"data: {}\n\n") + b"40\r\npartial")
        await w.drain()

    run(hangs_up, posting_raises(httpx.RemoteProtocolError))
    run(cut, streaming_raises(httpx.RemoteProtocolError))


def test_each_engine_has_its_own_pool_and_a_removed_one_is_closed() -> None:
    async def test(url: str, s: Server, ups: Upstreams) -> None:
        other = url.replace("127.0.0.1", "localhost")
        await ups.get(url + "/health")
        await ups.get(other + "/health")
        assert len(ups) == 2 and s.connections == 2
        await ups.forget(other)
        assert len(ups) == 1
        await s.closed.wait()  # its connection closed with it

    run(answering, test)


def test_a_request_timeout_overrides_the_default() -> None:
    async def test(url: str, s: Server, ups: Upstreams) -> None:
        req = ups.build_request("GET", url, timeout=2.5)
        assert req.extensions["timeout"] == {"connect": 2.5, "read": 2.5, "write": 2.5,
                                             "pool": 2.5}
        assert ups.build_request("GET", url).extensions["timeout"]["read"] == WAIT_S

    run(answering, test)


@pytest.mark.parametrize(("exc", "kind"), [
    (aiohttp.ConnectionTimeoutError(), httpx.ConnectTimeout),
    (aiohttp.SocketTimeoutError(), httpx.ReadTimeout),
    (TimeoutError(), httpx.ReadTimeout),
    (aiohttp.ServerDisconnectedError(), httpx.RemoteProtocolError),
    (aiohttp.ClientPayloadError("cut"), httpx.RemoteProtocolError),
    (aiohttp.ClientOSError(104, "reset"), httpx.ReadError),
])
def test_every_client_failure_maps_to_the_httpx_kind_the_proxy_tells_apart(
        exc: BaseException, kind: type[httpx.TransportError]) -> None:
    req = httpx.Request("POST", "http://engine/v1/completions")
    got = mapped(exc, req)
    assert type(got) is kind and got.request is req and str(got)


def test_the_transport_belongs_to_its_loop_and_closes_cleanly() -> None:
    t = AiohttpTransport(4)

    async def go() -> None:
        await t.aclose()  # never used: nothing to close

    asyncio.run(go())
