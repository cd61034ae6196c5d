"""The OpenAI front: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``.

One request is admitted in this order, each step refusing before the next costs anything:
the key (401, headers only), the key's requests in flight (429, before a byte of the body
is read), the body's size (413, while it is read), its JSON and every field against the
request models (400, :mod:`kvcentric.router.api.api_models`), the rendered prompt's characters
(before tokenising) and tokens against the context (400 ``context_length_exceeded``,
:class:`kvcentric.router.api.limits.Bounds`). Only then is it hashed, decided and forwarded
(:class:`kvcentric.router.api.proxy.Proxy`). The in-flight slot is held until the answer is
sent, streamed ones included. Every refusal is a :class:`Refused`, turned into a response
here and nowhere else.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from kvcentric.router.api import api_models, limits
from kvcentric.router.api.auth import Caller
from kvcentric.router.api.errors import Refused
from kvcentric.router.api.relay import RelayResponse
from kvcentric.router.prompt_scan import scan, whole, worth_scanning
from kvcentric.router.tokenize import Plan

if TYPE_CHECKING:
    from kvcentric.router.api.app import RouterState


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json(raw: bytes) -> dict[str, Any]:
    """A JSON object body, or :class:`Refused` (400); ``NaN``/``Infinity`` are refused
    (not JSON, though Python's parser takes them)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Refused(400, f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise Refused(400, "the body must be a JSON object")
    return body


async def json_body(request: Request, max_bytes: int) -> dict[str, Any]:
    return parse_json(await limits.read_body(request.stream(), request.headers, max_bytes))


def _released(resp: Response, release: Callable[[], None]) -> Response:
    """``resp`` with ``release()`` called once its body has been sent (or now)."""
    if isinstance(resp, RelayResponse):
        resp.on_close(release)
    else:
        release()
    return resp


@dataclass(frozen=True)
class Deferred:
    """A text prompt to scan once the request's salt is known: ``exact_above``, the
    estimate above which the scan tokenises it whole and the count is checked against
    ``context`` (None: its bound is within the context already)."""

    plan: Plan
    exact_above: int | None
    context: int


def openai_routes(app: FastAPI, state: RouterState) -> None:
    cfg, bounds = state.cfg, state.bounds

    async def openai(request: Request, chat: bool) -> Response:
        received = time.perf_counter()
        endpoint = "chat" if chat else "completions"
        try:
            caller = state.auth.caller(request.headers)
            state.inflight.acquire(caller.budget)
        except Refused as refused:
            resp: Response = refused.response()
        else:
            def release() -> None:
                state.inflight.release(caller.budget)

            try:
                body, tokens = await _admit(request, chat)
                resp = _released(await _forward(request, chat, caller, body, tokens,
                                                received), release)
            except Refused as refused:
                release()
                resp = refused.response()
            except BaseException:
                release()
                raise
        state.metrics.requests.labels(endpoint, str(resp.status_code)).inc()
        return resp

    async def _admit(request: Request, chat: bool
                     ) -> tuple[dict[str, Any], np.ndarray | Deferred]:
        """The parsed body and the prompt's tokens, or :class:`Refused` (400/404/413). A
        long text prompt comes back :class:`Deferred`, tokenised later only as far as
        routing needs (:mod:`kvcentric.router.prompt_scan`)."""
        body = await json_body(request, cfg.limits.max_body_bytes)
        model = body.get("model", cfg.model)
        if model != cfg.model:
            raise Refused(404, f"model {model!r} does not exist; this router serves "
                          f"{cfg.model!r}")
        context = state.context()
        body = api_models.validate(state.chat_model if chat else state.completion_model, body,
                                   bounds, context)
        api_models.normalize(body, bounds)
        tokens = _prompt(body, chat, context)
        if isinstance(tokens, Plan):
            deferred = _deferred(tokens, body, context)
            if deferred is not None:
                return body, deferred
            tokens = await whole(state.tokenizer, tokens)
            bounds.check_tokens(len(tokens), context)
        bounds.fit_budget(body, len(tokens), context)
        return body, tokens

    def _deferred(plan: Plan, body: dict[str, Any], context: int) -> Deferred | None:
        """How a text prompt is tokenised when its scan may stop short of its end
        (:mod:`kvcentric.router.prompt_scan`), or None: tokenised whole now (no scan, or a
        ``min_tokens`` that only the exact count can check). Within the context whatever
        the count (its bound): no check; else the scan's estimate must stay under half
        the limit, or the count is exact and checked after the scan."""
        tok = state.tokenizer
        if not (cfg.cache.scan_prompts and tok.scans and worth_scanning(plan)):
            return None
        limit = bounds.prompt_tokens(context)
        bound = tok.token_bound(plan.text, plan.add_special_tokens)
        if bound <= limit:
            if (body.get("min_tokens") or 0) > context - bound:
                return None
            bounds.fit_budget(body, bound, context)  # changes no min_tokens: it fits
            return Deferred(plan, None, context)
        if body.get("min_tokens"):
            return None
        return Deferred(plan, limit // 2, context)

    def _prompt(body: dict[str, Any], chat: bool, context: int) -> np.ndarray | Plan:
        """The prompt's token ids when the request gave them, else how to tokenise its
        text (a chat's rendered with the template), its characters checked first."""
        tok = state.tokenizer
        if chat:
            try:
                text = tok.chat_text(body, bounds.template_kwargs)
            except ValueError as exc:
                raise Refused(400, str(exc)) from exc
            special = bool(body.get("add_special_tokens", False))
        else:
            prompt = body["prompt"]
            if isinstance(prompt, list):  # token ids, bounded by the schema
                bounds.check_tokens(len(prompt), context)
                return np.asarray(prompt, dtype=np.uint32)
            text, special = prompt, bool(body.get("add_special_tokens", True))
        bounds.check_chars(len(text), context)
        return tok.plan(text, special)

    async def _forward(request: Request, chat: bool, caller: Caller, body: dict[str, Any],
                       prompt: np.ndarray | Deferred, received: float) -> Response:
        salt = state.auth.salt(caller, body.get("cache_salt"))
        if salt is not None:
            body["cache_salt"] = salt  # the engines hash it into every block of the prompt
        conductor = state.conductor
        rest: Callable[[], Awaitable[list[bytes]]] | None = None
        if isinstance(prompt, Deferred):
            tok, plan = state.tokenizer, prompt.plan
            scanned = await scan(tok, plan, lambda ids: conductor.holds(ids, salt),
                                 exact_above=prompt.exact_above)
            tokens, n_tokens, complete = scanned.tokens, scanned.n_tokens, scanned.complete
            if prompt.exact_above is not None and complete:
                bounds.check_tokens(n_tokens, prompt.context)
                bounds.fit_budget(body, n_tokens, prompt.context)
            if not complete:
                async def rest() -> list[bytes]:
                    return conductor.hashes(await whole(tok, tok.replan(plan)), salt)
        else:
            tokens, n_tokens, complete = prompt, len(prompt), True
        hashes = conductor.hashes(tokens, salt)
        tail = conductor.tail(tokens, hashes, salt) if complete else None
        if state.replicator is not None:
            state.replicator.observe(hashes, tokens, salt, cut=not complete)
        # a router key is the router's business: never forwarded to the engines, which get
        # upstream.api_key when they check keys of their own
        forwarded = ("content-type", "accept", "x-request-id") if state.auth.enabled else \
            ("authorization", "content-type", "accept", "x-request-id")
        headers = {k: v for k, v in request.headers.items() if k.lower() in forwarded}
        if cfg.upstream.api_key:
            headers["authorization"] = f"Bearer {cfg.upstream.api_key}"
        assert state.proxy is not None
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return await state.proxy.handle(path, body, hashes, n_tokens, headers, tail,
                                        received, rest)

    async def completions(request: Request) -> Response:
        return await openai(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await openai(request, chat=True)

    # plain Starlette routes: FastAPI's would solve dependencies and open two exit stacks
    # per request for handlers that take the request alone (the OpenAPI document is
    # :mod:`kvcentric.router.api.openapi`'s, not generated from the routes)
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        try:
            state.auth.caller(request.headers)
        except Refused as refused:
            return refused.response()
        return JSONResponse({"object": "list", "data": [
            {"id": cfg.model, "object": "model", "owned_by": "kvcentric", "created": 0,
             "root": cfg.tokenizer, "max_model_len": state.context()}]})
