"""The router's published OpenAPI document, generated from the models it enforces.

Request bodies come from :mod:`kvcentric.router.api.api_models` (the same models that
validate requests) and from the instance spec's fields; every response the router can
give is listed with its content type: the OpenAI error body for 4xx/5xx, JSON or
``text/event-stream`` for completions, Prometheus text for ``/metrics``, HTML for
``/dashboard``. With API keys configured, the OpenAI operations and the admin operations
declare bearer security; with any key configured, so do ``/metrics`` and ``/dashboard``
(bearer or basic: the admin or the metrics key). ``POST /instances`` publishes
:data:`kvcentric.router.fleet.instance_spec.PATTERNS`, the very patterns the router checks.

``GET /docs`` (and ``/redoc``) is a self-contained page listing the operations, never
FastAPI's Swagger UI: that loads its scripts from a CDN (a blank page offline, and a third
party's code on the router's origin), and the PyPI package that bundles them
(``swagger-ui-bundle``) ships Swagger UI 4, which cannot show an OpenAPI 3.1 document.
The page says so and where the document is.
"""

from __future__ import annotations

import html
from typing import Any

from pydantic import BaseModel

from kvcentric.router.config import RouterConfig
from kvcentric.router.fleet.instance_spec import KINDS, PATTERNS, ROLES

# One server-sent event (OpenAPI before 3.2: the stream's ``schema`` describes each event);
# ``data`` is a JSON chunk of the completion, or ``[DONE]`` at the end.
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                            "id": {"type": "string"}, "retry": {"type": "integer"}}}
_REF = "#/components/schemas/{model}"
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message"],
    "properties": {"message": {"type": "string"}, "type": {"type": ["string", "null"]},
                   "code": {"type": ["integer", "string", "null"]}}}}}
COMPLETION = {"type": "object", "required": ["choices"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string"},
    "choices": {"type": "array", "items": {"type": "object"}},
    "usage": {"type": ["object", "null"]}}}
MODELS = {"type": "object", "required": ["data"], "properties": {
    "object": {"type": "string"},
    "data": {"type": "array", "items": {"type": "object", "required": ["id"]}}}}
HEALTH = {"type": "object", "required": ["status"], "properties": {
    "status": {"type": "string", "enum": ["ok", "unavailable"]},
    "prefill": {"type": "integer"}, "decode": {"type": "integer"},
    "instances": {"type": "integer"},
    "unhealthy": {"type": "array", "items": {
        "type": "object", "required": ["name", "role", "last_error"], "properties": {
            "name": {"type": "string"}, "role": {"type": "string", "enum": list(ROLES)},
            "url": {"type": "string"}, "last_error": {"type": "string"}}}},
    "reason": {"type": "string"}}}
INSTANCE = {"type": "object", "required": ["url"], "additionalProperties": False, "properties": {
    "url": {"type": "string", "pattern": PATTERNS["url"]},
    "role": {"type": "string", "enum": list(ROLES)},
    **{name: {"type": ["string", "null"], "pattern": PATTERNS[name]}
       for name in ("model", "name", "kv_events", "kv_events_replay", "compute")},
    "kind": {"type": "string", "enum": list(KINDS)},
    "bootstrap_port": {"type": ["integer", "null"], "minimum": 1, "maximum": 65535}},
    "allOf": [
        # a replay endpoint is asked only for what a live stream missed
        {"if": {"required": ["kv_events_replay"],
                "properties": {"kv_events_replay": {"type": "string"}}},
         "then": {"required": ["kv_events"], "properties": {"kv_events": {"type": "string"}}}},
        # the port a decode reaches an SGLang prefill server's KV at
        {"if": {"required": ["bootstrap_port"],
                "properties": {"bootstrap_port": {"type": "integer"}}},
         "then": {"required": ["kind", "role"],
                  "properties": {"kind": {"const": "sglang"}, "role": {"const": "prefill"}}}},
    ]}
REASONS = {400: "Malformed request or a value out of bounds; for a body the schema accepts, "
                "only a prompt too long for the context (code context_length_exceeded)",
           401: "Missing or invalid API key",
           403: "The key may not use this operation", 404: "Unknown model or instance",
           409: "An instance of that name exists, or the router cannot listen on its "
                "kv_events address on this host (in use, not a local address)",
           413: "Body too large",
           429: "Overloaded (SLO) or too many requests in flight; see Retry-After",
           502: "Every instance tried failed", 503: "No instance can serve it",
           504: "The instance did not answer in time"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _responses(ok: dict[int, tuple[str, dict[str, Any]]], errors: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {str(code): {"description": desc, "content": content}
                           for code, (desc, content) in ok.items()}
    for code in errors:
        out[str(code)] = {"description": REASONS[code], "content": _json({"$ref": _REF.format(
            model="Error")})}
        if code == 429:
            out[str(code)]["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
    return out


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": _json(schema)}


def _drop_null_defaults(node: Any) -> Any:
    """pydantic writes ``default: null`` for fields that are optional but not nullable;
    omitted is what such a field's default means, so the document leaves it out."""
    if isinstance(node, dict):
        return {k: _drop_null_defaults(v) for k, v in node.items()
                if not (k == "default" and v is None)}
    if isinstance(node, list):
        return [_drop_null_defaults(v) for v in node]
    return node


def build_openapi(cfg: RouterConfig, completion: type[BaseModel],
                  chat: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of a router with ``cfg`` and these request models."""
    schemas: dict[str, Any] = {"Error": ERROR, "InstanceSpec": INSTANCE}
    for model in (completion, chat):
        one = _drop_null_defaults(model.model_json_schema(ref_template=_REF))
        schemas.update(one.pop("$defs", {}))
        schemas[model.__name__] = one
    secured: list[dict[str, list[str]]] = [{"bearer": []}] if cfg.auth.enabled else []
    auth_errors = [401] if cfg.auth.enabled else []
    admin_errors = [401, 403] if cfg.auth.enabled or cfg.auth.admin_key else []
    stream = {"text/event-stream": {"schema": SSE_EVENT}}
    paths: dict[str, Any] = {}
    for path, model in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        paths[path] = {"post": {
            "summary": f"OpenAI {path}: routed to the instance pair with the lowest TTFT",
            "requestBody": _body({"$ref": _REF.format(model=model.__name__)}),
            "responses": _responses({200: ("Completion, or SSE chunks when stream is true",
                                           {**_json(COMPLETION), **stream})},
                                    [400, *auth_errors, 404, 413, 429, 502, 503, 504]),
            "security": secured}}
    paths["/v1/models"] = {"get": {"summary": "The served model", "security": secured,
                                   "responses": _responses({200: ("Models", _json(MODELS))},
                                                           auth_errors)}}
    paths["/health"] = {"get": {"summary": "Ready when some instance can prefill and decode",
                                "responses": {
                                    "200": {"description": "Ready", "content": _json(HEALTH)},
                                    "503": {"description": "Not ready",
                                            "content": _json(HEALTH)}}}}
    watch: list[dict[str, list[str]]] = [{"bearer": []}, {"basic": []}] if cfg.auth.keyed \
        else []
    watch_errors = [401, 403] if cfg.auth.keyed else []
    paths["/metrics"] = {"get": {"summary": "Prometheus metrics", "security": watch,
                                 "responses": _responses({200: (
                                     "Prometheus text format",
                                     {"text/plain": {"schema": {"type": "string"}}})},
                                     watch_errors)}}
    paths["/dashboard"] = {"get": {"summary": "Live status page (reads /metrics every 2 s)",
                                   "security": watch,
                                   "responses": _responses({200: (
                                       "A self-contained HTML page",
                                       {"text/html": {"schema": {"type": "string"}}})},
                                       watch_errors)}}
    admin: list[dict[str, list[str]]] = [{"bearer": []}] if cfg.auth.admin_key or \
        cfg.auth.enabled else []
    listing = {"type": "object", "required": ["instances"]}
    paths["/instances"] = {
        "get": {"summary": "Instances and what the router knows of them", "security": admin,
                "responses": _responses({200: ("Instances", _json(listing))}, admin_errors)},
        "post": {"summary": "Add an instance (admin)", "security": admin,
                 "requestBody": _body({"$ref": _REF.format(model="InstanceSpec")}),
                 "responses": _responses({201: ("Added", _json({"type": "object"}))},
                                         [400, *admin_errors, 409, 413])}}
    paths["/instances/{name}"] = {"delete": {
        "summary": "Remove an instance (admin)", "security": admin,
        "parameters": [{"name": "name", "in": "path", "required": True,
                        "schema": {"type": "string"}}],
        "responses": _responses({200: ("Removed", _json({"type": "object"}))},
                                [*admin_errors, 404])}}
    doc: dict[str, Any] = {"openapi": "3.1.0",
                           "info": {"title": "kvcentric router", "version": "1"},
                           "paths": paths, "components": {"schemas": schemas}}
    if secured or admin or watch:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    if watch:
        doc["components"]["securitySchemes"]["basic"] = {"type": "http", "scheme": "basic"}
    return doc


def docs_page(doc: dict[str, Any]) -> str:
    """``GET /docs``: the operations of ``doc`` as plain HTML (no script, nothing loaded
    from elsewhere), and why there is no interactive explorer (module docstring)."""
    rows = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            codes = ", ".join(sorted(op.get("responses", {})))
            rows.append(f"<tr><td><code>{method.upper()}</code></td><td><code>"
                        f"{html.escape(path)}</code></td><td>{html.escape(op['summary'])}"
                        f"</td><td>{codes}</td></tr>")
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>kvcentric router API"
        "</title><style>body{font-family:sans-serif;margin:2em;max-width:60em}"
        "td{padding:.2em .8em;border-bottom:1px solid #ddd}</style></head><body>"
        "<h1>kvcentric router API</h1>"
        "<p>The OpenAPI 3.1 document is <a href='/openapi.json'>/openapi.json</a>: open it "
        "in any OpenAPI viewer or client generator.</p>"
        "<p>No interactive explorer is served here: FastAPI's Swagger UI loads its "
        "scripts from a CDN (a blank page without internet, and third-party code on this "
        "router's origin), and the Python package that bundles them for local serving "
        "(<code>swagger-ui-bundle</code>) ships Swagger UI 4, which cannot show an "
        "OpenAPI 3.1 document.</p>"
        "<table><tr><th>Method</th><th>Path</th><th>What</th><th>Statuses</th></tr>"
        + "".join(rows) + "</table></body></html>")
