"""Instances behind the router: registry, per-instance load bookkeeping, health checks.

An :class:`Instance` owns a slot (its bit in :class:`router.fleet.prefix_index.PrefixIndex`),
its health, the engine's last ``/metrics`` snapshot and context length (``/v1/models``'
``max_model_len``), and the router's in-flight
bookkeeping: prefills it predicted and has not yet seen finish (``T_queue``) and the
measured prefill speed, both per :class:`Processor`, and decodes running. Everything here is touched
only from the router's event loop.

The app registers every instance out of rotation (``Registry.add(spec, healthy=False)``)
and it takes traffic only once a health check passed (:func:`check`): one registered with
an address nothing answers at is never chosen.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from kvcentric.router.api.upstream import Upstreams
from kvcentric.router.config import HealthConfig
from kvcentric.router.cost.processor import Processor
from kvcentric.router.fleet.engine_metrics import EngineStats, parse_engine_metrics
from kvcentric.router.fleet.instance_spec import InstanceSpec
from kvcentric.router.fleet.kv_events import EventListener, EventTranslator
from kvcentric.router.fleet.prefix_index import PrefixIndex

log = logging.getLogger("router.fleet.instances")


@dataclass
class Instance:
    spec: InstanceSpec
    slot: int
    healthy: bool = True  # in rotation (the app adds instances out of it: see Registry.add)
    failures: int = 0  # failed checks (or calls) in a row
    checked: bool = False  # a health check has answered either way
    # why the latest check (or call) failed, None once one passes: /instances, /health, 503s
    last_error: str | None = None
    failure_logged_at: float = float("-inf")  # monotonic time of the last failure logged
    max_model_len: int | None = None  # the engine's context, from its /v1/models
    # an SGLang server's /server_info, read once per (re)start: its page size and the
    # bootstrap port a decode reaches its KV at (None: not read yet, or not SGLang)
    server_info: ServerInfo | None = None
    stats: EngineStats = field(default_factory=EngineStats)
    metrics_at: float = float("-inf")  # monotonic time ``stats`` was last read
    # monotonic time a routed request's answer last started (Registry.answered), -inf
    # after a stream from it broke: a passive health check (HealthConfig.passive)
    answered_at: float = float("-inf")
    decodes: int = 0
    # prefill work the engine had waiting at ``metrics_at`` that this router did not send
    # (other router replicas'): each such request costed at ``prefill_mean_s``
    foreign_s: float = 0.0
    prefill_mean_s: float = 0.0  # moving mean of the prefills this router predicted here
    translator: EventTranslator | None = None
    listener: EventListener | None = None
    proc: Processor = field(default_factory=Processor)

    @property
    def name(self) -> str:
        return str(self.spec.name)

    # ---- the processor: prefill queue (T_queue) and speed, shared on one compute ----
    def queue_s(self, now: float, work_s: float = 0.0) -> float:
        """Predicted seconds, beyond ``work_s`` itself, until ``work_s`` seconds of prefill
        sent here now are done (its own queue, busy peers on its processor, and what is
        left of the work other routers queued here: :meth:`foreign_left`)."""
        return self.proc.queue_s(self.name, now, work_s) + self.foreign_left(now)

    def foreign_left(self, now: float) -> float:
        """Seconds of prefill other routers had queued here at the last ``/metrics`` read,
        less the time since (the engine works it off meanwhile)."""
        return max(0.0, self.foreign_s - max(0.0, now - self.metrics_at))

    @property
    def bootstrap_port(self) -> int | None:
        """The port SGLang decodes reach this prefill server's KV at: configured, else
        what its ``/server_info`` said (None: neither)."""
        if self.spec.bootstrap_port is not None:
            return self.spec.bootstrap_port
        return self.server_info.bootstrap_port if self.server_info else None

    def read_stats(self, stats: EngineStats, now: float) -> None:
        """Take a ``/metrics`` snapshot read at ``now``. Requests waiting on the engine
        beyond this router's own (its predicted prefills not yet answered, less the one
        that may be running) were sent by other router replicas: without them several
        routers each see a fraction of an instance's queue and all send the next hot
        request to it."""
        info = self.server_info
        if stats.cache_tokens and info is not None and info.page_size:
            stats.page_size = info.page_size  # SGLang's cache is in tokens on its page
            stats.num_pages = stats.cache_tokens // info.page_size
        self.stats = stats
        self.metrics_at = now
        own_waiting = max(0, self.queued - 1)
        self.foreign_s = max(0.0, stats.waiting - own_waiting) * self.prefill_mean_s

    def enqueue(self, rid: str, pred_s: float, now: float) -> None:
        self.proc.add(self.name, rid, pred_s, now)
        m = self.prefill_mean_s
        self.prefill_mean_s = pred_s if m == 0.0 else 0.8 * m + 0.2 * pred_s

    def prefill_done(self, rid: str, now: float) -> None:
        self.proc.done(rid, now)

    @property
    def queued(self) -> int:
        return self.proc.pending(self.name)

    @property
    def correction(self) -> float:
        """Actual / predicted prefill time on this instance's processor."""
        return self.proc.correction

    def observe(self, predicted_s: float, actual_s: float) -> None:
        self.proc.observe(predicted_s, actual_s)

    def batch(self) -> int:
        """Sequences decoding on the engine, counting the router's own in flight."""
        return max(self.decodes, int(self.stats.running))

    def describe(self, index: PrefixIndex, now: float) -> dict[str, object]:
        return {
            "name": self.name, "url": self.spec.url, "role": self.spec.role,
            "kind": self.spec.kind, "bootstrap_port": self.bootstrap_port,
            "model": self.spec.model, "compute": self.spec.compute, "healthy": self.healthy,
            "slot": self.slot,
            "queue_s": round(self.queue_s(now), 4), "queued_prefills": self.queued,
            "decodes": self.decodes, "running": self.stats.running,
            "waiting": self.stats.waiting, "kv_usage": self.stats.kv_usage,
            "resident_blocks": index.resident(self.slot),
            "cache_blocks": index.capacity(self.slot),
            "residency": "kv_events" if self.listener else "bookkeeping",
            "kv_event_batches": self.listener.batches if self.listener else 0,
            "kv_event_gaps": self.listener.gaps if self.listener else 0,
            "kv_event_batches_replayed": self.listener.replayed if self.listener else 0,
            "kv_event_pages": len(self.translator) if self.translator else 0,
            "correction": round(self.correction, 3),
            "max_model_len": self.max_model_len,
            "failures": self.failures, "last_error": self.last_error,
        }

    def why_not(self, model: str, *, prefill: bool) -> str | None:
        """Why this instance cannot take ``model``'s prefill (or decode) now, in words, or
        None when it can."""
        if self.spec.model is not None and self.spec.model != model:
            return f"serves model {self.spec.model!r}"
        if not (self.spec.can_prefill if prefill else self.spec.can_decode):
            return f"role {self.spec.role} does not {'prefill' if prefill else 'decode'}"
        return None if self.healthy else self.down_reason

    @property
    def down_reason(self) -> str:
        """Why this instance is out of rotation: its last error, or that no check passed."""
        if self.last_error is not None:
            return self.last_error
        return "no health check passed yet" if self.checked else "not checked yet"


class Registry:
    """Instances by name, each with a slot in the prefix index."""

    def __init__(self, index: PrefixIndex, default_blocks: int,
                 sharing: str = "serial", log_interval_s: float = 60.0) -> None:
        """``sharing``: how instances on one ``compute`` share it (``serial`` or ``fair``,
        :mod:`kvcentric.router.cost.processor`); ``log_interval_s``: a failing instance's
        failures are logged on the first and then at most this often."""
        self.index = index
        self.default_blocks = default_blocks
        self.sharing = sharing
        self.log_interval_s = log_interval_s
        self._by_name: dict[str, Instance] = {}

    def __iter__(self) -> Iterator[Instance]:
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> Instance | None:
        return self._by_name.get(name)

    def add(self, spec: InstanceSpec, healthy: bool = True) -> Instance:
        """Register ``spec`` (``KeyError`` for a name or url taken); ``healthy``: in
        rotation at once (False: once :func:`check` passes)."""
        if spec.name in self._by_name:
            raise KeyError(f"instance {spec.name!r} already exists")
        if any(i.spec.url == spec.url for i in self._by_name.values()):
            raise KeyError(f"an instance with url {spec.url} already exists")
        used = {i.slot for i in self._by_name.values()}
        slot = next(s for s in range(len(used) + 1) if s not in used)
        self.index.add_slot(slot, self.default_blocks)
        peer = next((i for i in self._by_name.values()
                     if spec.compute is not None and i.spec.compute == spec.compute), None)
        inst = Instance(spec, slot, healthy=healthy,
                        proc=peer.proc if peer else Processor(self.sharing))
        inst.proc.members += 1
        self._by_name[str(spec.name)] = inst
        return inst

    def remove(self, name: str) -> Instance:
        inst = self._by_name.pop(name)
        inst.proc.drop(name)
        self.index.drop_slot(inst.slot)
        if inst.listener is not None:
            inst.listener.close()
        return inst

    def candidates(self, model: str, *, prefill: bool) -> list[Instance]:
        """Healthy instances serving ``model`` that can prefill (or decode)."""
        return [i for i in self._by_name.values()
                if i.healthy and (i.spec.model or model) == model
                and (i.spec.can_prefill if prefill else i.spec.can_decode)]

    def why_none(self, model: str, *, prefill: bool, hide_urls: bool = False) -> str:
        """Why no instance can take ``model``'s prefill (or decode): one clause per
        instance (name, URL unless ``hide_urls``, role, reason)."""
        if not self._by_name:
            return "no instances are configured (add them under instances: or POST /instances)"
        parts = []
        for i in self._by_name.values():
            where = i.name if hide_urls else f"{i.name} ({i.spec.url})"
            parts.append(f"{where}, role {i.spec.role}: "
                         f"{i.why_not(model, prefill=prefill) or 'excluded for this request'}")
        return "; ".join(parts)

    def mark_failed(self, inst: Instance, threshold: int, reason: str,
                    now: float | None = None) -> None:
        """Count one failed check (or call) of ``inst``: logged on the first of a run of
        failures and then at most every ``log_interval_s`` (URL and reason), and out of
        rotation from the ``threshold``-th."""
        now = time.monotonic() if now is None else now
        inst.failures += 1
        inst.checked = True
        inst.last_error = reason
        if inst.healthy and inst.failures >= threshold:
            inst.healthy = False
            inst.failure_logged_at = now
            log.warning("instance %s (%s) out of rotation: %s", inst.name, inst.spec.url,
                        reason)
        elif inst.failures == 1 or now - inst.failure_logged_at >= self.log_interval_s:
            inst.failure_logged_at = now
            log.warning("instance %s (%s) failing (%d in a row, %s): %s", inst.name,
                        inst.spec.url, inst.failures,
                        "in rotation" if inst.healthy else "out of rotation", reason)

    def answered(self, inst: Instance, ok: bool = True) -> None:
        """A routed request's answer from ``inst`` started (``ok``: a 200 and its first
        bytes), or a stream from it broke (not ``ok``: the next check asks again)."""
        inst.answered_at = time.monotonic() if ok else float("-inf")

    def mark_ok(self, inst: Instance) -> None:
        if not inst.healthy:
            log.info("instance %s (%s) in rotation", inst.name, inst.spec.url)
            inst.metrics_at = float("-inf")  # a (re)started engine: read its gauges now
            inst.max_model_len = None  # and its context
            inst.server_info = None  # and an SGLang server's settings
        inst.failures = 0
        inst.checked = True
        inst.last_error = None
        inst.failure_logged_at = float("-inf")
        inst.healthy = True


async def check(inst: Instance, registry: Registry, client: Upstreams | httpx.AsyncClient,
                hc: HealthConfig, api_key: str | None = None) -> None:
    """One health check of ``inst``, and a metrics poll if ``hc.metrics_interval_s`` has
    passed since its last successful one (with it, the engine's context from
    ``/v1/models`` while unknown; ``api_key``: the engines' own key, which vLLM asks for
    there); updates its state in place. With ``hc.passive``, an instance in rotation
    that answered a routed request within ``hc.interval_s`` is not asked for
    ``/health`` until its metrics poll is due: then it is, so an engine that says it is
    unhealthy while it still answers (draining) leaves rotation all the same."""
    timeout_s, threshold = hc.timeout_s, hc.unhealthy_after
    now = time.monotonic()
    if (hc.passive and inst.healthy and not inst.failures
            and now - inst.answered_at < hc.interval_s
            and now - inst.metrics_at < hc.metrics_interval_s):
        return  # its answer was the check, and its gauges are not due
    try:
        r = await client.get(inst.spec.url + "/health", timeout=timeout_s)
        ok = r.status_code == 200
        reason = f"GET /health answered {r.status_code}"
    except httpx.HTTPError as exc:
        ok, reason = False, f"GET /health failed: {transport_reason(exc)}"
    if not ok:
        registry.mark_failed(inst, threshold, reason)
        return
    registry.mark_ok(inst)
    now = time.monotonic()
    if now - inst.metrics_at < hc.metrics_interval_s:
        return
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    if inst.spec.kind == "sglang" and inst.server_info is None:
        inst.server_info = await read_server_info(inst, client, timeout_s, headers)
    try:
        r = await client.get(inst.spec.url + "/metrics", timeout=timeout_s)
        if r.status_code == 200:
            inst.read_stats(parse_engine_metrics(r.text, inst.spec.kind), now)
    except (httpx.HTTPError, ValueError) as exc:
        log.debug("metrics of %s unavailable: %s", inst.name, exc)
    if inst.max_model_len is None:
        inst.max_model_len = await _context(inst, client, timeout_s, headers)


async def _context(inst: Instance, client: Upstreams | httpx.AsyncClient, timeout_s: float,
                   headers: dict[str, str]) -> int | None:
    """The smallest ``max_model_len`` ``inst``'s ``/v1/models`` lists, or None."""
    try:
        r = await client.get(inst.spec.url + "/v1/models", timeout=timeout_s, headers=headers)
        data = r.json().get("data") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        log.debug("models of %s unavailable: %s", inst.name, exc)
        return None
    lens = [m.get("max_model_len") for m in data or [] if isinstance(m, dict)]
    found = [n for n in lens if isinstance(n, int) and not isinstance(n, bool) and n > 1]
    return min(found) if found else None


@dataclass(frozen=True)
class ServerInfo:
    """What the router takes from an SGLang server's ``GET /server_info`` (its resolved
    server arguments, flat: ``page_size``, ``disaggregation_bootstrap_port``)."""

    page_size: int | None = None
    bootstrap_port: int | None = None


async def read_server_info(inst: Instance, client: Upstreams | httpx.AsyncClient,
                           timeout_s: float, headers: dict[str, str]) -> ServerInfo | None:
    """``inst``'s ``/server_info``, or None (unreachable or not JSON: asked again at the
    next metrics poll). A field of the wrong type reads as unknown."""
    try:
        r = await client.get(inst.spec.url + "/server_info", timeout=timeout_s,
                             headers=headers)
        raw = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as exc:
        log.debug("server info of %s unavailable: %s", inst.name, exc)
        return None
    if not isinstance(raw, dict):
        return None

    def positive(key: str, top: int) -> int | None:
        v = raw.get(key)
        ok = isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= top
        return v if ok else None

    return ServerInfo(positive("page_size", 1 << 20),
                      positive("disaggregation_bootstrap_port", 65535))


def transport_reason(exc: BaseException) -> str:
    """An HTTP client error in words: its message, else its kind (a timeout's is empty)."""
    text = str(exc).strip()
    kind = type(exc).__name__
    return f"{kind}: {text}" if text else kind


def fit_capacity(inst: Instance, index: PrefixIndex, block_size: int) -> None:
    """Size ``inst``'s LRU to its engine's KV cache, once the engine reported it (and
    bound its event translator's page map to twice that many pages)."""
    st = inst.stats
    if st.num_pages and st.page_size:
        blocks = st.num_pages * st.page_size // block_size
        if blocks > 0 and blocks != index.capacity(inst.slot):
            index.set_capacity(inst.slot, blocks)
        if inst.translator is not None:  # its page map: twice what the engine can hold
            inst.translator.max_pages = max(1024, 2 * st.num_pages)
