"""Bounds on one request: body size, the prompt's size, requests in flight.

Checked in request order, each as soon as its input is known: the caller's requests in
flight first, from the headers alone (429 with ``Retry-After``, before a byte of the body is
read), the body size while it is read (413, before it is parsed), every field against the
request models (400, :mod:`kvcentric.router.api.api_models`), the rendered prompt's characters
before it is tokenised and its tokens after (400 ``context_length_exceeded``, the message
vLLM gives). :class:`Bounds` resolves the configured limits
(:class:`kvcentric.router.config.LimitsConfig`) against the model once, at start;
:meth:`Bounds.context` narrows the context to what the engines report.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcentric.router.api.access_config import LimitsConfig
from kvcentric.router.api.errors import Refused

CONTEXT_EXCEEDED = "context_length_exceeded"  # OpenAI's error code for a prompt too long
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                 "max_sequence_length")


def model_context(model_dir: str | Path) -> int | None:
    """The model's context length from its ``config.json`` (or its ``text_config``), or
    None when it names none."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    for section in (cfg.get("text_config") or {}, cfg):
        for key in _CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                return value
    return None


@dataclass(frozen=True)
class Bounds:
    """The limits of :class:`LimitsConfig`, resolved against the served model.

    ``max_model_len``: the context the published schema assumes (configured, else the
    model's ``config.json``); engines reporting a smaller one narrow it per request
    (:meth:`context`). ``max_prompt_tokens`` < ``max_model_len``; ``max_prompt_chars``:
    prompt tokens times the tokenizer's longest token (unless configured);
    ``max_tokens`` <= ``max_model_len`` (``default_max_tokens``: the configured one, given
    to a request that names no budget). ``template_kwargs``: the chat template keys a
    request may set. ``salt_max``: the longest client ``cache_salt``."""

    max_body_bytes: int
    max_model_len: int
    max_prompt_tokens: int
    max_prompt_chars: int
    chars_per_token: int
    max_tokens: int
    default_max_tokens: int | None
    vocab_size: int
    max_n: int
    max_logprobs: int
    priority: tuple[int, int]
    template_kwargs: frozenset[str]
    salt_max: int

    @classmethod
    def resolve(cls, cfg: LimitsConfig, *, model_len: int | None, vocab_size: int,
                max_chars_per_token: int, template_kwargs: Iterable[str],
                salt_max: int) -> Bounds:
        """``ValueError`` when neither the config nor the model names a context."""
        ctx = cfg.max_model_len or model_len
        if ctx is None:
            raise ValueError("the model's config.json names no context length: set "
                             "limits.max_model_len")
        prompt = min(cfg.max_prompt_tokens or ctx - 1, ctx - 1)
        return cls(max_body_bytes=cfg.max_body_bytes, max_model_len=ctx,
                   max_prompt_tokens=prompt,
                   max_prompt_chars=cfg.max_prompt_chars or prompt * max(1, max_chars_per_token),
                   chars_per_token=max(1, max_chars_per_token),
                   max_tokens=min(cfg.max_tokens or ctx, ctx), default_max_tokens=cfg.max_tokens,
                   vocab_size=vocab_size, max_n=cfg.max_n, max_logprobs=cfg.max_logprobs,
                   priority=(cfg.min_priority, cfg.max_priority),
                   template_kwargs=frozenset(template_kwargs), salt_max=salt_max)

    def context(self, reported: Iterable[int]) -> int:
        """The context a request is held to: the smallest the engines report, at most the
        configured one."""
        return min([self.max_model_len, *reported])

    def check_chars(self, chars: int, context: int) -> None:
        """Refuse a rendered prompt of ``chars`` characters before tokenising it."""
        most = min(self.max_prompt_chars, self.prompt_tokens(context) * self.chars_per_token)
        if chars > most:
            raise too_long(context, f"contains {chars} characters (more than {most}, the "
                            f"most {self.prompt_tokens(context)} tokens can span)")

    def check_tokens(self, tokens: int, context: int) -> None:
        """Refuse a prompt of ``tokens`` tokens: it must leave room for one more."""
        most = self.prompt_tokens(context)
        if tokens > most:
            raise too_long(context, f"contains {tokens} input tokens; at most {most} are "
                            "accepted (the context less one for the answer)")

    def prompt_tokens(self, context: int) -> int:
        return min(self.max_prompt_tokens, context - 1)

    def fit_budget(self, body: dict[str, Any], tokens: int, context: int) -> None:
        """Make a validated body's token budget servable as vLLM serves it (in place): no
        budget above the context (vLLM refuses one; under it, it clamps to what the prompt
        leaves) and ``min_tokens`` at most what the prompt leaves (above it vLLM refuses)."""
        for name in ("max_tokens", "max_completion_tokens"):
            if body.get(name) is not None and body[name] > context:
                body[name] = context
        left = context - tokens
        if body.get("min_tokens") is not None and body["min_tokens"] > left:
            body["min_tokens"] = left


def too_long(context: int, what: str) -> Refused:
    """The ``context_length_exceeded`` refusal (vLLM's message) of a prompt that ``what``
    (e.g. "contains 9000 input tokens; at most 8191 are accepted")."""
    return Refused(400, f"This model's maximum context length is {context} tokens. However, "
                   f"your prompt {what}. Please reduce the length of the prompt.",
                   code=CONTEXT_EXCEEDED)


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


class InFlight:
    """Requests in flight per budget (an API key's tenant, or one shared budget).

    ``fleet``: how many instances the router knows now, read at each admission, so the
    per-instance bound follows instances added or dropped at run time."""

    def __init__(self, cfg: LimitsConfig, fleet: Callable[[], int]) -> None:
        self.per_key = cfg.max_concurrency_per_key
        self.per_instance = cfg.max_concurrency_per_instance
        self.fleet = fleet
        self.retry_after_s = cfg.retry_after_s
        self.counts: Counter[str] = Counter()

    def limit(self) -> int | None:
        """The bound on one budget now: the smaller of the two configured, ``None`` when
        neither is set."""
        bounds = [] if self.per_key is None else [self.per_key]
        if self.per_instance is not None:
            bounds.append(self.per_instance * max(1, self.fleet()))
        return min(bounds) if bounds else None

    def acquire(self, budget: str) -> None:
        """Count one more request of ``budget``, or raise 429 when it is at its limit."""
        limit = self.limit()
        if limit is not None and self.counts[budget] >= limit:
            raise Refused(429, f"too many requests in flight for this key (limit "
                          f"{limit}); retry later",
                          {"Retry-After": str(self.retry_after_s)})
        self.counts[budget] += 1

    def release(self, budget: str) -> None:
        self.counts[budget] -= 1
        if self.counts[budget] <= 0:
            del self.counts[budget]
