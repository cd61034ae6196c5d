"""An ASGI app served for real by uvicorn, in a thread of the test process."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp

from kvcentric.testing.servers import free_port
from tests.helpers.waiting import wait_until


@contextlib.contextmanager
def served(app: ASGIApp, start_s: float = 30.0) -> Iterator[str]:
    """``app`` (its lifespan included) served on a free loopback port until the block
    ends; yields its base URL. Fails if it has not started within ``start_s``."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started, start_s), "the server did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
