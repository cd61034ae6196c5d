"""One streamed OpenAI request over ``httpx``, timed like ``vllm bench serve`` times it.

``send`` never raises for a failed request: HTTP errors, stream errors and exceptions end
up in the returned :class:`RequestRecord` (``success=False``, ``status``, ``error``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .metrics import RequestRecord

if TYPE_CHECKING:  # httpx comes with the router extra: imported where a request is made
    import httpx

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MAX_RETRY_AFTER_S = 60.0


@dataclass(frozen=True)
class Api:
    """How to talk to the server(s): endpoint kind, model name, sampling extras."""

    model: str
    endpoint: str = "completions"
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_ids: str | None = None  # send ``x-request-id: <this>/<sid>/<turn>`` (None: none)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}")

    def body(self, prompt: Any, max_tokens: int) -> dict[str, Any]:
        """The JSON body: ``prompt`` is text/ids (completions) or messages (chat)."""
        key = "messages" if self.endpoint == "chat" else "prompt"
        out = {"model": self.model, key: prompt, "max_tokens": max_tokens,
               "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            out["ignore_eos"] = True
        return out | self.extra_body


@dataclass
class _Stream:
    """What a stream delivered so far."""

    t0: float
    last: float = 0.0
    text: list[str] = field(default_factory=list)
    chunks: int = 0
    usage: dict[str, Any] | None = None

    def feed(self, obj: dict[str, Any], chat: bool, rec: RequestRecord) -> None:
        now = time.perf_counter()
        if obj.get("usage"):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if not piece:
                continue
            if self.chunks == 0:
                rec.ttft_s = now - self.t0
            else:
                rec.itl_s.append(now - self.last)
            self.last = now
            self.chunks += 1
            self.text.append(piece)


async def send(client: httpx.AsyncClient, base_url: str, api: Api, prompt: Any,
               rec: RequestRecord, t_origin: float, retry_429: int = 0,
               failover: tuple[str, ...] = ()) -> str:
    """Send one request, fill ``rec`` in place and return the generated text.

    A 429 is sent again up to ``retry_429`` times after its ``Retry-After`` (seconds,
    capped at ``MAX_RETRY_AFTER_S``; 1 s when absent), as the OpenAI SDK does; TTFT and
    latency then count from the first attempt, waits included. ``failover``: URLs to try
    in turn when a connection cannot be made (nothing was sent: what a load balancer in
    front of several routers does), counted in ``rec.failovers``.
    """
    t0 = time.perf_counter()
    rec.start_s, rec.url = t0 - t_origin, base_url
    others = [u for u in failover if u != base_url]
    while True:
        wait, text = await _attempt(client, rec.url, api, prompt, rec, t0)
        if rec.error.startswith(("ConnectError", "ConnectTimeout")) and others:
            rec.url = others.pop(0)
            rec.failovers += 1
            continue
        if wait is None or rec.retries >= retry_429:
            return text
        rec.retries += 1
        await asyncio.sleep(wait)


async def _attempt(client: httpx.AsyncClient, base_url: str, api: Api, prompt: Any,
                   rec: RequestRecord, t0: float) -> tuple[float | None, str]:
    """One try: (seconds to wait before retrying a 429, else None; the generated text)."""
    import httpx
    chat = api.endpoint == "chat"
    st = _Stream(t0)
    rec.error = ""
    try:
        headers = ({"x-request-id": f"{api.request_ids}/{rec.sid}/{rec.turn}"}
                   if api.request_ids is not None else None)
        async with client.stream("POST", base_url.rstrip("/") + ENDPOINTS[api.endpoint],
                                 json=api.body(prompt, rec.max_tokens), headers=headers) as r:
            rec.status = r.status_code
            rec.predicted_ttft_s = _predicted(r)
            rec.router_s = _header_ms(r, "x-kvc-router-ms")
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                rec.error = f"HTTP {r.status_code}: {_message(body)}"
                return (_retry_after(r) if r.status_code == 429 else None), ""
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    rec.error = f"stream error: {_message(json.dumps(obj))}"
                    return None, ""
                st.feed(obj, chat, rec)
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return None, ""
    rec.latency_s = time.perf_counter() - t0
    _finish(rec, st)
    return None, "".join(st.text)


def _predicted(r: httpx.Response) -> float | None:
    """The TTFT the kvcentric router predicted for this request (its response header)."""
    return _header_ms(r, "x-kvc-predicted-ttft-ms")


def _header_ms(r: httpx.Response, name: str) -> float | None:
    """A milliseconds header as seconds, None when absent or not a number."""
    try:
        return float(r.headers[name]) / 1e3
    except (KeyError, ValueError):
        return None


def _retry_after(r: httpx.Response) -> float:
    try:
        return min(MAX_RETRY_AFTER_S, max(0.0, float(r.headers.get("retry-after", "1"))))
    except ValueError:  # an HTTP date: not sent by the servers we target
        return 1.0


def _finish(rec: RequestRecord, st: _Stream) -> None:
    usage = st.usage or {}
    rec.output_tokens = int(usage.get("completion_tokens") or st.chunks)
    if usage.get("prompt_tokens") is not None:
        rec.server_prompt_tokens = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        rec.cached_tokens = int(details["cached_tokens"])
    if st.chunks == 0:
        rec.error = "the stream carried no content"
        return
    rec.success = True


def _message(body: str) -> str:
    """The ``message`` of an OpenAI error body, else the body's start."""
    try:
        obj = json.loads(body)
        err = obj.get("error", obj)
        msg = err.get("message") if isinstance(err, dict) else err
        return str(msg or obj.get("detail") or body)[:300]
    except (ValueError, AttributeError):
        return body[:300]
