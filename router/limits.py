"""Bounds on one request: body size, prompt tokens, ``max_tokens``, requests in flight.

Checked in request order, each as soon as its input is known: the body size while it is
read (413, before it is parsed), ``max_tokens`` right after parsing and the prompt length
after tokenising (400), and the caller's requests in flight before any upstream work (429
with ``Retry-After``). ``None`` bounds in :class:`kvcentric.router.config.LimitsConfig`
are left to the engine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Mapping
from typing import Any

from kvcentric.router.config import LimitsConfig
from kvcentric.router.errors import Refused

TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


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


def check_max_tokens(body: Mapping[str, Any], cfg: LimitsConfig) -> None:
    """400 unless every token budget field is absent/null or an integer in range."""
    for name in TOKEN_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise Refused(400, f"{name} must be a positive integer, got {value!r}")
        if cfg.max_tokens is not None and value > cfg.max_tokens:
            raise Refused(400, f"{name} is {value}; this router allows at most "
                          f"{cfg.max_tokens}")


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
