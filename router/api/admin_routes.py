"""Operator endpoints: ``GET /health`` (open: probes), ``GET /metrics`` (the admin or the
metrics key once any key is configured), ``GET/POST /instances`` and
``DELETE /instances/{name}`` (the admin key).

``POST /instances`` accepts exactly what its published schema accepts
(:data:`kvcentric.router.fleet.instance_spec.PATTERNS`); the instance joins out of rotation and
the answer comes after its first health check (``healthy`` in the body says how it went):
an instance nothing answers at is registered but takes no traffic until it answers.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import zmq
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from kvcentric.router.api.errors import Refused, error_response
from kvcentric.router.api.openai_routes import json_body
from kvcentric.router.fleet.instance_spec import InstanceSpec

if TYPE_CHECKING:
    from kvcentric.router.api.app import RouterState


def admin_routes(app: FastAPI, state: RouterState) -> None:
    cfg = state.cfg

    @app.get("/health")
    async def health() -> JSONResponse:
        """Ready when some instance can prefill and some can decode; ``unhealthy`` lists
        the instances out of rotation with their ``last_error`` (and URL, unless API keys
        are set: this endpoint is open, and ``/instances`` shows the operator the URLs)."""
        reg = state.conductor.registry
        pre = len(reg.candidates(cfg.model, prefill=True))
        dec = len(reg.candidates(cfg.model, prefill=False))
        ok = pre > 0 and dec > 0
        body: dict[str, object] = {
            "status": "ok" if ok else "unavailable", "prefill": pre, "decode": dec,
            "instances": len(reg),
            "unhealthy": [{"name": i.name, "role": i.spec.role,
                           **({} if cfg.auth.enabled else {"url": i.spec.url}),
                           "last_error": i.down_reason}
                          for i in reg if not i.healthy]}
        if not ok:
            body["reason"] = (f"no healthy instance that can "
                              f"{'prefill' if not pre else 'decode'}: "
                              + reg.why_none(cfg.model, prefill=not pre,
                                             hide_urls=cfg.auth.enabled))
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        try:
            state.auth.check_metrics(request.headers)
        except Refused as refused:
            return refused.response()
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.api_route("/instances", methods=["GET", "POST"])
    async def instances(request: Request) -> JSONResponse:
        # one route for both methods: a 405 then names both in its Allow header
        try:
            state.auth.check_admin(request.headers)
            if request.method == "POST":
                return await _add_instance(request)
        except Refused as refused:
            return refused.response()
        now = time.monotonic()
        c = state.conductor
        return JSONResponse({"instances": [i.describe(c.index, now) for i in c.registry],
                             "keys": {"block_size": c.block_size,
                                      "model_id": cfg.model_id,
                                      "layout_sig": c.store.layout_sig},
                             "store": {"enabled": c.store.enabled, "queries": c.store.queries,
                                       "errors": c.store.errors}})

    async def _add_instance(request: Request) -> JSONResponse:
        spec = None
        try:
            spec = InstanceSpec.from_dict(await json_body(request, cfg.limits.max_body_bytes))
            inst = await state.add_instance_rebinding(spec)
        except ValueError as exc:
            return error_response(400, str(exc))
        except KeyError as exc:
            return error_response(409, str(exc.args[0]))
        except zmq.ZMQError as exc:  # a well-formed address this host cannot take
            assert spec is not None
            return error_response(409, f"cannot listen on {spec.kv_events}: {exc}")
        await state.check_instance(inst)  # in rotation only if it answers
        if state.conductor.registry.get(inst.name) is not inst:  # deleted meanwhile
            return JSONResponse({"name": inst.name, "removed": True}, status_code=201)
        return JSONResponse(inst.describe(state.conductor.index, time.monotonic()),
                            status_code=201)

    @app.delete("/instances/{name}")
    async def delete_instance(name: str, request: Request) -> JSONResponse:
        try:
            state.auth.check_admin(request.headers)
        except Refused as refused:
            return refused.response()
        if state.conductor.registry.get(name) is None:
            return error_response(404, f"no instance {name!r}")
        inst = state.remove_instance(name)
        return JSONResponse({"removed": inst.name})
