"""Mooncake's Conductor indexer API, served by the router (docs/router.md §Indexer API).

``POST /register`` and ``POST /unregister`` (KV event publishers), ``POST /query`` (token
ids) and ``POST /query_by_hash`` (rolling sequence hashes), ``GET /services`` and the debug
``GET /global_view``: the paths, field names, defaults and response shapes of Mooncake's
``conductor-indexer.md``, so a gateway configured for Mooncake's Conductor can point at the
router unchanged. Every endpoint needs the admin key, as the router's other operator
endpoints do. Bad bodies get a 400 naming the field; an unknown publisher on
``/unregister`` a 404; a second registration of the same ``instance_id|tenant_id|dp_rank``
a 409.

:class:`StandardIndexer` owns the publishers (one event listener each, on the router's
loop) and the index; :func:`indexer_routes` only parses and answers.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse

from kvcentric.router.api.errors import Refused, error_response
from kvcentric.router.api.openai_routes import json_body
from kvcentric.router.fleet.indexer import Scope, TierIndex
from kvcentric.router.fleet.indexer_feeds import PUBLISHER_TYPES, Publisher, Registration
from kvcentric.router.fleet.kv_events import EventListener
from kvcentric.seq_hash import seq_hashes

if TYPE_CHECKING:
    from kvcentric.router.api.app import RouterState
    from kvcentric.router.config import IndexerConfig

# A publisher binds; the indexer connects: a wildcard host cannot be connected to.
_ENDPOINT = re.compile(r"^(tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]+):\d{1,5}|ipc:///\S+)$")
_NAME_MAX = 256


@dataclass(frozen=True)
class Query:
    """One ``/query`` or ``/query_by_hash`` body, checked."""

    scope: Scope
    instance_id: str | None
    token_ids: tuple[int, ...] | None = None
    seq_hashes: tuple[int, ...] | None = None


class StandardIndexer:
    """The publishers registered through the API and the index they feed."""

    def __init__(self, cfg: IndexerConfig) -> None:
        self.cfg = cfg
        self.index = TierIndex()
        self.publishers: dict[str, Publisher] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def register(self, reg: Registration, ctx: zmq.asyncio.Context) -> Publisher:
        """Start consuming ``reg``'s events (with a replay first when it names a replay
        endpoint). ``KeyError`` when its key is taken, ``OverflowError`` past
        ``max_publishers``, ``zmq.ZMQError`` when its endpoint cannot be connected."""
        if reg.key in self.publishers:
            raise KeyError(f"publisher {reg.key} is already registered: unregister it first")
        if len(self.publishers) >= self.cfg.max_publishers:
            raise OverflowError(f"{len(self.publishers)} publishers are registered, the "
                                f"most indexer.max_publishers allows")
        pub = Publisher(reg, self.index, self.cfg.seed, self.cfg.max_blocks_per_publisher)
        pub.listener = EventListener(ctx, reg.endpoint, pub.on_events, bind=False,
                                     replay=reg.replay_endpoint)
        self.index.add_publisher(reg.key, self.cfg.max_blocks_per_publisher)
        self.publishers[reg.key] = pub
        self._tasks[reg.key] = asyncio.get_running_loop().create_task(pub.listener.run())
        return pub

    def unregister(self, key: str) -> Publisher:
        """Stop ``key``'s listener and forget its blocks; ``KeyError`` if unknown."""
        pub = self.publishers.pop(key)
        task = self._tasks.pop(key, None)
        if task is not None:
            task.cancel()
        if pub.listener is not None:
            pub.listener.close()
        self.index.drop_publisher(key)
        return pub

    def close(self) -> None:
        """Stop every listener (before the ZMQ context is terminated)."""
        for key in list(self.publishers):
            self.unregister(key)

    def instances(self, q: Query) -> dict[str, set[int]]:
        """Engine instances a query answers for: registered for the query's model, block
        size and tenant (and the one it names), with their DP ranks."""
        out: dict[str, set[int]] = {}
        s = q.scope
        for pub in self.publishers.values():
            r = pub.reg
            if (r.pool or r.model != s.model or r.block_size != s.block_size
                    or r.tenant_id != s.tenant_id
                    or (q.instance_id is not None and r.instance_id != q.instance_id)):
                continue
            out.setdefault(r.instance_id, set()).add(r.dp_rank)
        return out

    def query(self, q: Query) -> dict[str, dict[str, dict[str, object]]]:
        """The Conductor's answer: ``{tenant: {instance: {longest_matched, GPU, CPU,
        DISK, DP}}}``, in tokens."""
        hashes = (list(q.seq_hashes) if q.seq_hashes is not None
                  else seq_hashes(q.token_ids or (), q.scope.block_size, self.cfg.seed))
        matches = self.index.match(q.scope, hashes, self.instances(q))
        size = q.scope.block_size
        return {q.scope.tenant_id: {i: m.as_json(size) for i, m in sorted(matches.items())}}

    def global_view(self) -> dict[str, Any]:
        scopes = self.index.scopes()
        return {"context_count": len(scopes),
                "model_contexts": [{"model_name": s.model, "lora_name": s.lora_name,
                                    "block_size": s.block_size, "additional_salt": s.salt,
                                    "tenant_id": s.tenant_id, "blocks": n}
                                   for s, n in sorted(scopes.items(), key=lambda x: repr(x[0]))],
                "blocks": self.index.blocks(), "forgotten": self.index.forgotten}


# ---- bodies ----
def _str(body: Mapping[str, Any], name: str, *, default: str | None = None,
         wire: str | None = None) -> str:
    """A string field (``wire``: its name on the wire); absent or null is ``default``, or
    a 400 naming the field when there is none."""
    wire = wire or name
    value = body.get(wire)
    if value is None:
        if default is None:
            raise Refused(400, f"{wire} is required (a string)")
        return default
    if not isinstance(value, str) or len(value) > _NAME_MAX:
        raise Refused(400, f"{wire} must be a string of at most {_NAME_MAX} characters")
    return value


def _int(body: Mapping[str, Any], name: str, lo: int, hi: int,
         default: int | None = None) -> int:
    value = body.get(name, default)
    if value is None:
        raise Refused(400, f"{name} is required (an integer)")
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise Refused(400, f"{name} must be an integer in [{lo}, {hi}], got {value!r}"[:200])
    return value


def _endpoint(body: Mapping[str, Any], name: str, required: bool) -> str | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not _ENDPOINT.match(value):
        raise Refused(400, f"{name} must be the publisher's address, tcp://HOST:PORT or "
                           "ipc:///PATH (the publisher binds it; no wildcard host)")
    return value


def _only(body: Mapping[str, Any], allowed: tuple[str, ...], what: str) -> None:
    unknown = sorted(str(k) for k in body if k not in allowed)
    if unknown:
        raise Refused(400, f"unknown field(s) in {what}: {', '.join(unknown)[:200]}; "
                           f"allowed: {', '.join(allowed)}")


_REGISTER = ("endpoint", "replay_endpoint", "type", "modelname", "lora_name", "tenant_id",
             "instance_id", "block_size", "dp_rank", "additionalsalt")
_UNREGISTER = ("type", "modelname", "lora_name", "tenant_id", "instance_id", "block_size",
               "dp_rank", "additionalsalt")
_QUERY = ("model", "lora_name", "lora_id", "token_ids", "tenant_id", "instance_id",
          "block_size", "cache_salt")
_QUERY_HASH = (*[f for f in _QUERY if f != "token_ids"], "seq_hashes", "block_hash")


def parse_registration(body: Mapping[str, Any]) -> Registration:
    _only(body, _REGISTER, "a registration")
    kind = _str(body, "type")
    if kind not in PUBLISHER_TYPES:
        raise Refused(400, f"type must be one of {', '.join(PUBLISHER_TYPES)}, got {kind!r}")
    endpoint = _endpoint(body, "endpoint", required=True)
    assert endpoint is not None
    return Registration(
        endpoint=endpoint, type=kind, model=_str(body, "model", wire="modelname"),
        instance_id=_str(body, "instance_id"),
        block_size=_int(body, "block_size", 1, 1 << 20),
        dp_rank=_int(body, "dp_rank", 0, 1 << 16),
        replay_endpoint=_endpoint(body, "replay_endpoint", required=False),
        lora_name=_str(body, "lora_name", default=""),
        tenant_id=_str(body, "tenant_id", default="default") or "default",
        salt=_str(body, "additionalsalt", default=""))


def unregister_key(body: Mapping[str, Any]) -> str:
    _only(body, _UNREGISTER, "an unregistration")
    tenant = _str(body, "tenant_id", default="default") or "default"
    return f"{_str(body, 'instance_id')}|{tenant}|{_int(body, 'dp_rank', 0, 1 << 16)}"


def parse_query(body: Mapping[str, Any], by_hash: bool, max_blocks: int) -> Query:
    _only(body, _QUERY_HASH if by_hash else _QUERY, "a query")
    lora = _str(body, "lora_name", default="")
    if body.get("lora_id") is not None:
        raise Refused(400, "lora_id is deprecated and not supported: send lora_name")
    size = _int(body, "block_size", 1, 1 << 20)
    scope = Scope(_str(body, "model"), lora, size, _str(body, "cache_salt", default=""),
                  _str(body, "tenant_id", default="default") or "default")
    inst = body.get("instance_id")
    instance = None if inst is None else _str(body, "instance_id")
    if by_hash:
        name = "seq_hashes" if "seq_hashes" in body else "block_hash"
        return Query(scope, instance, seq_hashes=_ints(body, name, 2**64 - 1, max_blocks))
    return Query(scope, instance, token_ids=_ints(body, "token_ids", 2**32 - 1,
                                                  max_blocks * size))


def _ints(body: Mapping[str, Any], name: str, hi: int, most: int) -> tuple[int, ...]:
    values = body.get(name)
    if not isinstance(values, list):
        raise Refused(400, f"{name} is required (a list of integers)")
    if len(values) > most:
        raise Refused(400, f"{name} has {len(values)} entries, more than the {most} a query "
                           "may carry (indexer.max_query_blocks blocks)")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
            raise Refused(400, f"{name} must hold integers in [0, {hi}], got {v!r}"[:200])
    return tuple(values)


def indexer_routes(app: FastAPI, state: RouterState) -> None:
    """Wire the indexer API onto ``app`` (see the module docstring)."""
    indexer = state.indexer
    max_body = state.cfg.limits.max_body_bytes
    max_blocks = indexer.cfg.max_query_blocks

    async def guarded(request: Request,
                      answer: Callable[[dict[str, Any]], JSONResponse]) -> JSONResponse:
        try:
            state.auth.check_admin(request.headers)
            body = await json_body(request, max_body) if request.method == "POST" else {}
            if not isinstance(body, dict):
                raise Refused(400, "the body must be a JSON object")
            return answer(body)
        except Refused as refused:
            return refused.response()

    def register(body: dict[str, Any]) -> JSONResponse:
        reg = parse_registration(body)
        assert state.zmq_ctx is not None
        try:
            indexer.register(reg, state.zmq_ctx)
        except KeyError as exc:
            return error_response(409, str(exc.args[0]))
        except OverflowError as exc:
            return error_response(409, str(exc))
        except zmq.ZMQError as exc:
            return error_response(400, f"cannot connect to {reg.endpoint}: {exc}")
        return JSONResponse({"status": "registered successfully",
                             "instance_id": reg.instance_id})

    def unregister(body: dict[str, Any]) -> JSONResponse:
        key = unregister_key(body)
        if key not in indexer.publishers:
            return error_response(404, f"no publisher {key} is registered")
        indexer.unregister(key)
        return JSONResponse({"status": "unregistered successfully",
                             "removed_instances": [key]})

    @app.post("/register")
    async def register_route(request: Request) -> JSONResponse:
        return await guarded(request, register)

    @app.post("/unregister")
    async def unregister_route(request: Request) -> JSONResponse:
        return await guarded(request, unregister)

    @app.post("/query")
    async def query_route(request: Request) -> JSONResponse:
        return await guarded(request, lambda b: JSONResponse(
            indexer.query(parse_query(b, False, max_blocks))))

    @app.post("/query_by_hash")
    async def query_by_hash_route(request: Request) -> JSONResponse:
        return await guarded(request, lambda b: JSONResponse(
            indexer.query(parse_query(b, True, max_blocks))))

    @app.get("/services")
    async def services_route(request: Request) -> JSONResponse:
        return await guarded(request, lambda _: JSONResponse({"services": [
            p.describe() for p in indexer.publishers.values()]}))

    @app.get("/global_view")
    async def global_view_route(request: Request) -> JSONResponse:
        return await guarded(request, lambda _: JSONResponse(indexer.global_view()))
