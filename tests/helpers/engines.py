"""The session's pool of plain vLLM engines (registered as fixtures in tests/conftest.py).

Starting a vLLM CPU server is most of what an engine test costs, and many tests only need
a plain engine: the reference answers a connector engine is held to, or an upstream a
router forwards to. Those share one engine per configuration for the whole session.

Contract of :func:`plain_tiny` (and of every engine :class:`EnginePool` hands out):

- a vLLM CPU server of the ``tiny`` model, float32, no connector, with
  ``--enable-prompt-tokens-details`` (usage reports cached tokens; nothing else changes);
  greedy tokens are the same in every process, so its answers are a reference for any
  engine of the same model and dtype;
- started on the first test that asks for it, stopped when the session ends; the pool
  owns it: a test never stops, kills or reconfigures it;
- shared: its metrics never start at zero, and its prefix cache holds whatever earlier
  tests sent. A test that counts its prefix-cache hits resets that cache first
  (``reset_prefix_cache``); a test that needs counters from zero, a connector, other flags,
  or an engine it may kill starts its own :class:`~kvcentric.testing.servers.VllmServer`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcentric.testing.servers import VllmServer

PLAIN_ARGS = ("--enable-prompt-tokens-details",)


class EnginePool:
    """Plain engines by (model name, extra args), started on first request, all stopped by
    :meth:`close`."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self._made: dict[tuple[str, tuple[str, ...]], VllmServer] = {}

    def plain(self, model: str = "tiny", args: tuple[str, ...] = PLAIN_ARGS) -> VllmServer:
        """The pool's ready engine of ``model`` (a :mod:`kvcentric.testing.models` name)
        with ``args``; started now if it is the first request for that configuration."""
        key = (model, args)
        if key not in self._made:
            from kvcentric.testing.models import build_model  # heavy imports: only when used

            path = str(build_model(model, Path.cwd() / ".models" / model))
            srv = VllmServer(path, name=model, args=args,
                             log_path=self.logs / f"{model}-{len(self._made)}.log")
            self._made[key] = srv  # stopped by close() even when it never gets ready
            srv.start().wait_ready()
        return self._made[key]

    def close(self) -> None:
        for srv in self._made.values():
            srv.stop()
        self._made.clear()


@pytest.fixture(scope="session")
def engine_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnginePool]:
    """The session's :class:`EnginePool`; its engines are stopped at the session's end."""
    pool = EnginePool(tmp_path_factory.mktemp("engine-pool"))
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def plain_tiny(engine_pool: EnginePool) -> VllmServer:
    """The shared plain ``tiny`` engine (see the module docstring for what a test may and
    may not assume of it)."""
    return engine_pool.plain()
