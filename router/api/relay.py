"""A streamed answer relayed to the client chunk by chunk, as the engine sends it.

Why not Starlette's ``StreamingResponse``: under uvicorn's ASGI 2.3 it runs every stream
in an anyio task group with a second task listening for the client's disconnect, and
cancelling that group at the end formats the task's repr (its callbacks and their
arguments). Per streamed request that costs the router more CPU than relaying the chunks.
:class:`RelayResponse` keeps what that machinery is for, with one plain asyncio task: a
client that hangs up ends the relay at once (the upstream stream is closed, so the engine
aborts the request instead of decoding for nobody), and the callbacks given to
:meth:`RelayResponse.on_close` run exactly once however the relay ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class RelayResponse(Response):
    """Sends ``chunks`` (bytes, passed through untouched) as the body of a 200-class
    streamed response. The iterator is closed (``aclose``) when the relay ends, whether
    it was exhausted, the client disconnected, or the task was cancelled; then the
    :meth:`on_close` callbacks run, in the order they were added."""

    def __init__(self, chunks: AsyncIterator[bytes], status_code: int = 200,
                 headers: Mapping[str, str] | None = None,
                 media_type: str | None = None) -> None:
        self.body_iterator = chunks
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)
        self._on_close: list[Callable[[], None]] = []
        self._closed = False

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once the relay has ended (or at once if it already has)."""
        if self._closed:
            fn()
        else:
            self._on_close.append(fn)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay = asyncio.current_task()
        assert relay is not None
        streaming = True
        gone = False

        async def watch() -> None:
            nonlocal gone
            # the body was read before this response was made: what comes now is the
            # client going away (or uvicorn saying the response is complete)
            while (await receive())["type"] != "http.disconnect":
                pass
            if streaming:
                gone = True
                relay.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            streaming = False
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            relay.uncancel()  # our own cancel: the client left, nothing more to send
        finally:
            streaming = False
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            try:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self._closed = True
                callbacks, self._on_close = self._on_close, []
                for fn in callbacks:
                    fn()
