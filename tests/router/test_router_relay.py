"""A streamed answer through the router served by uvicorn for real
(:mod:`kvcentric.router.api.relay`): the bytes pass through untouched, and a client that
hangs up mid-stream ends the relay at once: the engine's stream is closed (so vLLM aborts
the request instead of decoding for nobody), the decode instance's count and the key's
in-flight slot are given back. Fake engines as in tests/router/test_router_app.py."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from kvcentric.router.api.app import RouterState, build_app
from kvcentric.router.api.relay import RelayResponse
from kvcentric.router.tokenize import PromptTokenizer
from tests.helpers.served import served
from tests.router.test_router_app import PROFILE, TWO, Upstreams, make_cfg

WAIT_S = 30.0  # a bound on events that come in milliseconds; never a sleep


@dataclass
class Endless(Upstreams):
    """Fake engines whose streams send a chunk whenever the previous one was read, until
    closed; ``closed`` is set when the router closed one."""

    closed: threading.Event = field(default_factory=threading.Event)
    sent: int = 0

    async def _sse(self, host: str) -> AsyncIterator[bytes]:
        try:
            while True:
                self.sent += 1
                yield f'data: {{"choices":[{{"text":"t{self.sent}-{host}"}}]}}\n\n'.encode()
                await asyncio.sleep(0.001)  # a decode step: lets the loop serve others
        finally:
            self.closed.set()


@pytest.fixture
def router(tiny_dir: str, tokenizer: PromptTokenizer) -> Iterator[tuple[str, Endless,
                                                                          RouterState]]:
    """The router over endless fake engines, served by uvicorn on a free port."""
    engines = Endless()
    app = build_app(make_cfg(tiny_dir, TWO), transport=httpx.MockTransport(engines.handler),
                    tokenizer=tokenizer, profile=PROFILE)
    with served(app) as url:
        yield url, engines, app.state.router


def _settled(state: RouterState) -> threading.Event:
    """Set once nothing is in flight in ``state`` (polled on the router's own loop would
    need its loop; the counters are plain ints read between its steps)."""
    done = threading.Event()

    def poll() -> None:
        for _ in range(int(WAIT_S / 0.01)):
            if not state.inflight.counts and all(
                    i.decodes == 0 for i in state.conductor.registry):
                done.set()
                return
            threading.Event().wait(0.01)

    threading.Thread(target=poll, daemon=True).start()
    return done


def test_a_client_that_hangs_up_mid_stream_closes_the_engines_stream(
        router: tuple[str, Endless, RouterState]) -> None:
    url, engines, state = router
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 1000, "stream": True}
    with httpx.Client(base_url=url, timeout=WAIT_S) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            host = r.headers["x-kvc-decode"]
            got = b""
            chunks = r.iter_raw()  # held: dropping the iterator would close the connection
            for chunk in chunks:
                got += chunk
                if got.count(b"\n\n") >= 3:
                    break
            # the bytes are the engine's, in order, untouched
            assert got.startswith(b'data: {"choices":[{"text":"t1-' + host.encode() + b'"}]}'
                                  b"\n\n"), got[:200]
            assert not engines.closed.is_set()
            assert state.inflight.counts  # the slot is held while the answer streams
        # leaving the block closes the connection mid-stream
        del chunks
    assert engines.closed.wait(WAIT_S), "the router kept reading an engine nobody listens to"
    assert _settled(state).wait(WAIT_S), (state.inflight.counts,
                                          [i.decodes for i in state.conductor.registry])
    # and the router still serves: a whole stream goes through to its end
    engines.closed.clear()
    with httpx.Client(base_url=url, timeout=WAIT_S) as c:
        r = c.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(" from ")


def test_a_client_that_hangs_up_at_once_still_frees_the_engine(
        router: tuple[str, Endless, RouterState]) -> None:
    """The client sends the request and closes its socket before reading anything."""
    url, engines, state = router
    port = int(url.rsplit(":", 1)[1])
    payload = b'{"model": "tiny", "prompt": "hello world", "max_tokens": 1000, "stream": true}'
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: "
                  b"application/json\r\ncontent-length: " + str(len(payload)).encode() +
                  b"\r\n\r\n" + payload)
        head = s.recv(65536)  # the answer has started: the relay is running
        assert head.startswith(b"HTTP/1.1 200"), head[:100]
    assert engines.closed.wait(WAIT_S), "the router kept reading an engine nobody listens to"
    assert _settled(state).wait(WAIT_S), (state.inflight.counts,
                                          [i.decodes for i in state.conductor.registry])


def test_close_callbacks_run_once_and_a_late_one_at_once() -> None:
    """A whole relay: every chunk sent in order, the end of the body, the iterator closed,
    the callbacks run once; one added after the end runs when added."""
    calls: list[str] = []
    sent: list[dict[str, object]] = []

    async def chunks() -> AsyncIterator[bytes]:
        try:
            yield b"a"
            yield b"b"
        finally:
            calls.append("closed")

    async def go() -> None:
        done = asyncio.Event()

        async def receive() -> dict[str, object]:
            await done.wait()  # the client stays until the response is complete
            return {"type": "http.disconnect"}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)
            if message.get("more_body") is False:
                done.set()

        resp = RelayResponse(chunks(), media_type="text/event-stream")
        resp.on_close(lambda: calls.append("released"))
        await resp({"type": "http"}, receive, send)  # type: ignore[arg-type]
        resp.on_close(lambda: calls.append("late"))

    asyncio.run(go())
    assert [m.get("body") for m in sent] == [None, b"a", b"b", b""]
    assert calls == ["closed", "released", "late"]
