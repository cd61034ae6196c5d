"""Bounds on one request: body size, prompt tokens, requests in flight.

Checked in request order, each as soon as its input is known: the body size while it is
read (413, before it is parsed), the prompt length after tokenising (400; ``max_tokens``
is bounded by the request models, :mod:`kvcentric.router.api_models`), and the caller's
requests in flight before any upstream work (429 with ``Retry-After``). ``None`` bounds
in :class:`kvcentric.router.config.LimitsConfig` are left to the engine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Mapping

from kvcentric.router.config import LimitsConfig
from kvcentric.router.errors import Refused


async def read_body(chunks: AsyncIterator[bytes], headers: Mapping[str, str],
                    limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit``
    bytes (a declared ``Content-Length`` first, then the bytes actually received)."""
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Refused(413, f"the body is {declared} bytes; at most {limit} are accepted")
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > limit:
            raise Refused(413, f"the body exceeds {limit} bytes")
    return bytes(body)


def check_prompt(num_tokens: int, cfg: LimitsConfig) -> None:
    if cfg.max_prompt_tokens is not None and num_tokens > cfg.max_prompt_tokens:
        raise Refused(400, f"the prompt has {num_tokens} tokens; this router allows at most "
                      f"{cfg.max_prompt_tokens}")


class InFlight:
    """Requests in flight per budget (an API key's tenant, or one shared budget)."""

    def __init__(self, cfg: LimitsConfig) -> None:
        self.limit = cfg.max_concurrency_per_key
        self.retry_after_s = cfg.retry_after_s
        self.counts: Counter[str] = Counter()

    def acquire(self, budget: str) -> None:
        """Count one more request of ``budget``, or raise 429 when it is at its limit."""
        if self.limit is not None and self.counts[budget] >= self.limit:
            raise Refused(429, f"too many requests in flight for this key (limit "
                          f"{self.limit}); retry later",
                          {"Retry-After": str(self.retry_after_s)})
        self.counts[budget] += 1

    def release(self, budget: str) -> None:
        self.counts[budget] -= 1
        if self.counts[budget] <= 0:
            del self.counts[budget]
