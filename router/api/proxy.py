"""Forward one OpenAI request along a decision: single instance or prefill -> decode.

Bodies, status codes, SSE streams and usage fields pass through unchanged. With separate
roles the prefill instance gets the request with ``max_tokens=1`` (not streamed; its
connector saves the prompt's KV to the store) and then the decode instance gets the full
request (its connector loads that KV) and its answer is relayed.

An SGLang pair (``kind: sglang``) runs SGLang's disaggregation protocol as sglang-router
drives it: both servers get the request at once, each with the prefill server's
``bootstrap_host`` and ``bootstrap_port`` and one random ``bootstrap_room``; the decode
server fetches the KV from the prefill server by that room (SGLang's transfer engine, not
the store) and its answer is relayed. A prefill that fails first fails the pair (the decode
is abandoned: it would wait for KV that never comes) and the pair is retried elsewhere.

Failures: a refused or broken connection or a 5xx from an instance before the first byte
reached the client takes that instance out of rotation and the request is decided again
without it: at most ``upstream.retries`` times, except that an instance the request never
reached (the connection could not be made) does not count, so a request is answered 502
only once every healthy instance it could go to failed, or the retries ran out on engines
that saw it. Nothing decodes twice: a decode is
retried only when the failed one is known to have stopped with nothing the client saw; a
read timeout (the engine may still be working) is answered 504 without retry. A failure
mid-stream ends the stream with an SSE error event.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import urlparse

import httpx
from starlette.responses import Response

from kvcentric.hashing import TailRef
from kvcentric.router.api.errors import error_response
from kvcentric.router.api.relay import RelayResponse
from kvcentric.router.api.upstream import Upstreams
from kvcentric.router.conductor import Conductor
from kvcentric.router.cost.decision import Decision, Rejection
from kvcentric.router.fleet.instances import Instance
from kvcentric.router.ops.metrics import RouterMetrics, hit_tiers

log = logging.getLogger("router.api.proxy")
# prompts whose rest is hashed in the background at once (more are left to the engines'
# KV events): each holds a tokenising worker thread
BEYOND_MAX = 8
_FORWARD_HEADERS = ("authorization", "content-type", "accept", "x-request-id")


class UpstreamFailed(Exception):
    """The instance failed before the client saw a byte: retry elsewhere is safe.
    ``unreached``: no connection was made, the engine never saw the request."""

    def __init__(self, inst: Instance, reason: str, unreached: bool = False) -> None:
        super().__init__(f"{inst.name}: {reason}")
        self.inst = inst
        self.reason = reason
        self.unreached = unreached


class UpstreamTimeout(Exception):
    """The instance did not answer in time: it may still be working, so no retry (a retry
    could decode the request twice)."""


def _transport_error(inst: Instance, exc: httpx.TransportError) -> Exception:
    if isinstance(exc, (httpx.ReadTimeout, httpx.WriteTimeout)):
        return UpstreamTimeout(f"{inst.name}: {type(exc).__name__}")
    return UpstreamFailed(inst, f"{type(exc).__name__}: {exc}",
                          unreached=isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)))


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The request the prefill instance runs: same prompt, one token, not streamed."""
    out = {k: v for k, v in body.items()
           if k not in ("stream", "stream_options", "min_tokens", "n", "best_of")}
    out["max_tokens"] = 1
    if chat:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    return out


async def _abandon(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` unless done, and wait until it is (whatever it then raises)."""
    if not task.done():
        task.cancel()
        await asyncio.wait((task,))  # its outcome is the caller's to read


class Proxy:
    def __init__(self, conductor: Conductor, client: Upstreams | httpx.AsyncClient,
                 metrics: RouterMetrics) -> None:
        self.conductor = conductor
        self.client = client
        self.metrics = metrics
        self.retries = conductor.cfg.upstream.retries
        self.fail_after = conductor.cfg.health.unhealthy_after
        self._pending: set[asyncio.Future[Any]] = set()  # SGLang prefills still running
        self._beyond: set[asyncio.Task[None]] = set()  # scans' rest being hashed

    async def handle(self, path: str, body: dict[str, Any], hashes: Sequence[bytes],
                     n_tokens: int, headers: dict[str, str],
                     tail: TailRef | None = None, received: float | None = None,
                     rest: Callable[[], Awaitable[Sequence[bytes]]] | None = None
                     ) -> Response:
        """Decide, dispatch, retry on failure; returns the client's response. ``received``:
        when the router got the request (``perf_counter``; default now): the response's
        ``x-kvc-router-ms`` is the time from then to the dispatch that answered. ``rest``:
        for a prompt whose scan stopped short (``hashes`` cover its start only), gives the
        whole prompt's block hashes; called once, after the first dispatch, off this
        request's path (:meth:`Conductor.resident_beyond_scan`)."""
        rid = uuid.uuid4().hex
        t_arrival = time.perf_counter()
        received_at = t_arrival if received is None else received
        stream = bool(body.get("stream"))
        exclude: set[str] = set()
        last = "no attempt"
        retries = self.retries
        for attempt in itertools.count():  # ends: every failure excludes its instance
            t0 = time.perf_counter()
            decision = await self.conductor.decide(hashes, n_tokens, exclude, tail)
            self.metrics.decision_seconds.observe(time.perf_counter() - t0)
            if isinstance(decision, Rejection):
                if attempt:
                    break  # nothing else can take it: report the upstream failure
                return self._reject(decision)
            self._count(decision, n_tokens)
            self.conductor.dispatched(decision, rid, hashes, stream or decision.disaggregated)
            if rest is not None:
                self._resident_beyond_scan(decision, rid, rest)
                rest = None
            if decision.awaits is not None:
                await self._hold(decision, rid, hashes)
            sent = time.perf_counter()
            added_ms = (sent - received_at) * 1e3
            try:
                if decision.disaggregated and decision.prefill.spec.kind == "sglang":
                    return await self._bootstrapped(decision, rid, path, body, headers,
                                                    t_arrival, added_ms, sent)
                if decision.disaggregated:
                    early = await self._prefill(decision, rid, path, body, headers)
                    if early is not None:
                        self.conductor.finished(decision, rid)
                        return early
                if stream:
                    return await self._stream(decision, rid, path, body, headers, t_arrival,
                                              added_ms, sent)
                return await self._whole(decision, rid, path, body, headers, added_ms)
            except UpstreamTimeout as exc:
                self.conductor.finished(decision, rid)
                return error_response(504, f"upstream timed out: {exc}", "upstream_timeout")
            except UpstreamFailed as exc:
                self.conductor.finished(decision, rid)
                self._failed(exc)
                exclude.add(exc.inst.name)
                last = str(exc)
                if not exc.unreached:  # the engine saw it: a retry spends the budget
                    if retries == 0:
                        break
                    retries -= 1
                self.metrics.retries.labels("decode" if exc.inst is decision.decode
                                            and decision.disaggregated else "prefill").inc()
        return error_response(502, f"upstream failed: {last}", "upstream_error")

    async def _hold(self, d: Decision, rid: str, hashes: Sequence[bytes]) -> None:
        """Hold request ``rid`` until the prefix ``d`` waits for is in the store (or its
        bound passed: the engine then computes what is missing)."""
        t0 = time.perf_counter()
        try:
            landed = await self.conductor.hold(d, hashes)
        except BaseException:  # the client left meanwhile: the decision ends here
            self.conductor.finished(d, rid)
            raise
        self.metrics.held.labels("landed" if landed else "late").inc()
        self.metrics.held_seconds.observe(time.perf_counter() - t0)

    def _resident_beyond_scan(self, d: Decision, rid: str,
                              rest: Callable[[], Awaitable[Sequence[bytes]]]) -> None:
        """Hash the rest of request ``rid``'s prompt (dispatched as ``d``) in the
        background and count it resident where ``d`` sent it; skipped while
        :data:`BEYOND_MAX` are running (a flood of long new prompts costs no more
        tokenising than scanning them)."""
        if len(self._beyond) >= BEYOND_MAX:
            return

        async def run() -> None:
            try:
                hashes = await rest()
            except Exception as exc:  # a routing hint lost, nothing more
                log.debug("hashing the rest of a scanned prompt failed: %s", exc)
                return
            self.conductor.resident_beyond_scan(d, rid, hashes)

        task = asyncio.get_running_loop().create_task(run())
        self._beyond.add(task)
        task.add_done_callback(self._beyond.discard)

    def _reject(self, r: Rejection) -> Response:
        self.metrics.rejections.labels(r.reason).inc()
        if r.reason == "no_instance":
            return error_response(503, r.message, "service_unavailable",
                                  {"Retry-After": str(r.retry_after_s)})
        return error_response(429, r.message, "slo_rejected",
                              {"Retry-After": str(r.retry_after_s)})

    def _count(self, d: Decision, n_tokens: int) -> None:
        m = self.metrics
        m.decisions.labels(d.prefill.name, d.decode.name).inc()
        m.ttft_predicted.observe(d.ttft_s)
        m.prompt_tokens.labels(d.prefill.name).inc(n_tokens)
        m.hit_tokens.labels(d.prefill.name).inc(d.hit_tokens)
        m.local_hit_tokens.labels(d.prefill.name).inc(
            min(d.local_blocks * self.conductor.params.block_size, n_tokens))
        m.count_hits(*hit_tiers(d, n_tokens, self.conductor.params.block_size))
        if d.replicated:
            m.replications.inc()
        if d.over_slo:
            m.over_slo.inc()

    def _failed(self, exc: UpstreamFailed) -> None:
        self.metrics.upstream_errors.labels(exc.inst.name).inc()
        log.warning("upstream failed, trying another instance: %s", exc)
        # a refused connection is conclusive; the health loop brings it back when it answers
        self.conductor.registry.mark_failed(exc.inst, 1 if "connect" in exc.reason.lower()
                                    else self.fail_after, exc.reason)

    def _headers(self, d: Decision, headers: dict[str, str],
                 added_ms: float | None = None) -> dict[str, str]:
        out = {**headers, "x-kvc-prefill": d.prefill.name, "x-kvc-decode": d.decode.name,
               "x-kvc-predicted-ttft-ms": f"{d.ttft_s * 1000:.1f}",
               "x-kvc-hit-tokens": str(d.hit_tokens)}
        if added_ms is not None:
            out["x-kvc-router-ms"] = f"{added_ms:.1f}"
        return out

    async def _post(self, inst: Instance, path: str, content: bytes,
                    headers: dict[str, str]) -> httpx.Response:
        try:
            r = await self.client.post(inst.spec.url + path, content=content, headers=headers)
        except httpx.TransportError as exc:
            raise _transport_error(inst, exc) from exc
        if r.status_code >= 500:
            raise UpstreamFailed(inst, f"HTTP {r.status_code}: {r.text[:200]}")
        self.conductor.registry.answered(inst)
        return r

    async def _prefill(self, d: Decision, rid: str, path: str, body: dict[str, Any],
                       headers: dict[str, str]) -> Response | None:
        """Run the prefill on p; a 4xx answer (the request's fault) goes to the client."""
        t0 = time.perf_counter()
        pbody = prefill_body(body, chat=path.endswith("chat/completions"))
        r = await self._post(d.prefill, path, json.dumps(pbody).encode(), headers)
        actual = time.perf_counter() - t0
        if r.status_code != 200:
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        self.metrics.prefill_actual.observe(actual)
        self.conductor.prefill_finished(d, rid, actual)
        return None

    async def _bootstrapped(self, d: Decision, rid: str, path: str, body: dict[str, Any],
                            headers: dict[str, str], t_arrival: float, added_ms: float,
                            sent: float) -> Response:
        """An SGLang pair: prefill and decode at once, joined by a bootstrap room (see the
        module docstring). Raises what :meth:`_post` and :meth:`_stream` raise, for the
        instance that failed first; the other request is then abandoned."""
        pd = {**body, "bootstrap_host": urlparse(d.prefill.spec.url).hostname,
              "bootstrap_port": d.prefill.bootstrap_port,
              # SGLang's rooms are non-negative int64s
              "bootstrap_room": secrets.randbits(63)}
        pre = asyncio.ensure_future(self._post(
            d.prefill, path, json.dumps(prefill_body(pd, path.endswith("chat/completions"))
                                        ).encode(), headers))
        dec = asyncio.ensure_future(
            self._stream(d, rid, path, pd, headers, t_arrival, added_ms, sent)
            if pd.get("stream") else self._whole(d, rid, path, pd, headers, added_ms))

        def prefilled(task: asyncio.Future[httpx.Response]) -> None:
            if not task.cancelled() and task.exception() is None:
                actual = time.perf_counter() - sent
                self.metrics.prefill_actual.observe(actual)
                self.conductor.prefill_finished(d, rid, actual)

        pre.add_done_callback(prefilled)
        self._pending.add(pre)  # it may outlive this call (a decode streaming meanwhile)
        pre.add_done_callback(self._pending.discard)
        try:
            await asyncio.wait((pre, dec), return_when=asyncio.FIRST_COMPLETED)
            if pre.done() and not dec.done():
                r = pre.result()  # a failed prefill fails the pair (the caller retries)
                if r.status_code != 200:  # the request's fault: the prefill's answer says why
                    await _abandon(dec)
                    self.conductor.finished(d, rid)
                    return Response(r.content, r.status_code,
                                    media_type=r.headers.get("content-type"))
            return await dec
        finally:
            # whoever raised, the caller ends the decision (``finished``) once
            await _abandon(dec)
            if dec.cancelled() or dec.exception() is not None or dec.result().status_code != 200:
                pre.cancel()  # the decode failed or refused: nobody waits for this KV

    async def _whole(self, d: Decision, rid: str, path: str, body: dict[str, Any],
                     headers: dict[str, str], added_ms: float | None = None) -> Response:
        r = await self._post(d.decode, path, json.dumps(body).encode(), headers)
        self.conductor.finished(d, rid)
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"),
                        headers=self._headers(d, {}, added_ms))

    async def _stream(self, d: Decision, rid: str, path: str, body: dict[str, Any],
                      headers: dict[str, str], t_arrival: float,
                      added_ms: float | None = None, sent: float | None = None) -> Response:
        """Relay d's SSE stream; the first chunk is awaited here so a failure before any
        byte reached the client can still be retried elsewhere. ``sent``: when the request
        was dispatched (``perf_counter``; default ``t_arrival``): the prefill time the cost
        model's correction learns from runs from then, not counting the router's own time."""
        inst = d.decode
        req = self.client.build_request("POST", inst.spec.url + path,
                                        content=json.dumps(body).encode(), headers=headers)
        try:
            up = await self.client.send(req, stream=True)
        except httpx.TransportError as exc:
            raise _transport_error(inst, exc) from exc
        if up.status_code >= 500:
            text = (await up.aread())[:200]
            await up.aclose()
            raise UpstreamFailed(inst, f"HTTP {up.status_code}: {text!r}")
        if up.status_code != 200:
            content = await up.aread()
            await up.aclose()
            self.conductor.finished(d, rid)
            return Response(content, up.status_code, media_type=up.headers.get("content-type"))
        chunks = up.aiter_raw()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except httpx.TransportError as exc:
            await up.aclose()
            raise _transport_error(inst, exc) from exc
        except BaseException:  # cancelled (an SGLang pair's prefill failed): let it go
            await up.aclose()
            raise
        t_first = time.perf_counter()
        self.conductor.registry.answered(inst)
        self.metrics.observe_ttft(d.ttft_s, t_first - t_arrival)
        if not d.disaggregated:
            self.conductor.prefill_finished(d, rid, t_first - (t_arrival if sent is None else sent))
        return RelayResponse(self._relay(d, rid, up, first, chunks),
                             status_code=200, headers=self._headers(d, {}, added_ms),
                             media_type=up.headers.get("content-type", "text/event-stream"))

    async def _relay(self, d: Decision, rid: str, up: httpx.Response, first: bytes,
                     chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
        except httpx.TransportError as exc:
            self.conductor.registry.answered(d.decode, ok=False)
            self.metrics.upstream_errors.labels(d.decode.name).inc()
            log.warning("stream from %s broke: %s", d.decode.name, exc)
            err = {"error": {"message": f"upstream {d.decode.name} failed mid-stream",
                             "type": "upstream_error", "code": 502}}
            yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            await up.aclose()
            self.conductor.finished(d, rid)
