"""Prometheus metrics of one router (own registry: no process-wide state).

Counters and histograms are updated on the request path; per-instance load, residency
and prefix heat are read from the live state at scrape time by :class:`_StateCollector`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvcentric.router.conductor import Conductor
    from kvcentric.router.cost.decision import Decision
    from kvcentric.router.tokenize import PromptTokenizer

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
_DECISION_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1)
_ERROR_BUCKETS = (0.05, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1.0, 2.0, 5.0)
TIERS = ("engine", "store_dram", "store_disk")
TOP_PREFIXES = 10


class RouterMetrics:
    def __init__(self, conductor: Conductor, tokenizer: PromptTokenizer | None = None) -> None:
        """The router's metrics over its own registry; ``tokenizer``: the prompt
        tokenizer whose work is exported at scrape time (None: not exported)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvc_router_requests", "Requests answered, by endpoint and "
                                "status", ["endpoint", "status"], registry=r)
        self.decisions = Counter("kvc_router_decisions", "Routing decisions, by chosen pair",
                                 ["prefill", "decode"], registry=r)
        self.rejections = Counter("kvc_router_rejections", "Requests refused (429/503), by "
                                  "reason", ["reason"], registry=r)
        self.over_slo = Counter("kvc_router_over_slo", "Requests served best effort: "
                                "predicted to miss the TTFT SLO even with no queue",
                                registry=r)
        self.retries = Counter("kvc_router_retries", "Requests retried on another instance",
                               ["stage"], registry=r)
        self.upstream_errors = Counter("kvc_router_upstream_errors", "Failed upstream calls",
                                       ["instance"], registry=r)
        self.replications = Counter("kvc_router_replications", "Requests sent where the "
                                    "prefix must be loaded from the store although another "
                                    "instance holds it (hot-spot spreading)", registry=r)
        self.prompt_tokens = Counter("kvc_router_prompt_tokens", "Prompt tokens routed",
                                     ["instance"], registry=r)
        self.hit_tokens = Counter("kvc_router_predicted_hit_tokens", "Prompt tokens predicted "
                                  "reused (local cache or store)", ["instance"], registry=r)
        self.local_hit_tokens = Counter("kvc_router_predicted_local_hit_tokens", "Prompt "
                                        "tokens predicted resident on the chosen instance",
                                        ["instance"], registry=r)
        self.tier_hits = Counter("kvc_router_predicted_hit_tokens_by_tier", "Prompt tokens "
                                 "predicted reused, by where they come from: the chosen "
                                 "engine's cache or the store's DRAM or disk tier", ["tier"],
                                 registry=r)
        for tier in TIERS:  # every tier exported from the start, 0 until it hits
            self.tier_hits.labels(tier)
        self.ttft_predicted = Histogram("kvc_router_ttft_predicted_seconds", "Predicted TTFT",
                                        buckets=_TTFT_BUCKETS, registry=r)
        self.ttft_actual = Histogram("kvc_router_ttft_actual_seconds", "Measured TTFT "
                                     "(streamed requests)", buckets=_TTFT_BUCKETS, registry=r)
        self.ttft_ratio = Histogram("kvc_router_ttft_actual_over_predicted", "Measured / "
                                    "predicted TTFT", buckets=_RATIO_BUCKETS, registry=r)
        self.ttft_error = Histogram("kvc_router_ttft_relative_error", "|measured - predicted| "
                                    "/ measured TTFT (streamed requests)",
                                    buckets=_ERROR_BUCKETS, registry=r)
        self.prefill_actual = Histogram("kvc_router_prefill_seconds", "Measured prefill "
                                        "calls (disaggregated)", buckets=_TTFT_BUCKETS,
                                        registry=r)
        self.decision_seconds = Histogram("kvc_router_decision_seconds", "Time to decide "
                                          "(hash, match, store view, cost model)",
                                          buckets=_DECISION_BUCKETS, registry=r)
        self.held = Counter("kvc_router_held", "Requests held until the prefix they load "
                            "was stored by another request's in-flight prefill, by result "
                            "(landed, or late: sent when the hold's bound passed)",
                            ["result"], registry=r)
        for result in ("landed", "late"):
            self.held.labels(result)
        self.held_seconds = Histogram("kvc_router_held_seconds", "Time requests were held "
                                      "for a prefix on its way into the store",
                                      buckets=_TTFT_BUCKETS, registry=r)
        self.warmups = Counter("kvc_router_warmups", "Hot-prefix warm-up requests sent to "
                               "idle instances (replication), by result", ["result"],
                               registry=r)
        self.heap_released = Counter("kvc_router_heap_released_bytes", "Resident memory "
                                     "the periodic malloc_trim gave back to the system",
                                     registry=r)
        r.register(_StateCollector(conductor))
        if tokenizer is not None:
            r.register(_TokenizerCollector(tokenizer))

    def observe_ttft(self, predicted_s: float, actual_s: float) -> None:
        self.ttft_actual.observe(actual_s)
        if predicted_s > 0:
            self.ttft_ratio.observe(actual_s / predicted_s)
        if actual_s > 0:
            self.ttft_error.observe(abs(actual_s - predicted_s) / actual_s)

    def count_hits(self, engine: int, dram: int, disk: int) -> None:
        """Count one decision's predicted hit tokens by tier (see :func:`hit_tiers`)."""
        for tier, n in zip(TIERS, (engine, dram, disk)):
            self.tier_hits.labels(tier).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _TokenizerCollector(Collector):
    """The prompt tokenizer's counts, read when scraped: tokenising long prompts is
    much of the router's CPU, and the prompt token cache is what spares it."""

    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self.tokenizer = tokenizer

    def collect(self) -> Iterator[CounterMetricFamily]:
        t = self.tokenizer
        yield CounterMetricFamily("kvc_router_tokenized_tokens", "Prompt tokens the router "
                                  "tokenised (whole prompts, scan pieces, the prompt "
                                  "token cache's checks)", value=t.tokenized_tokens)
        yield CounterMetricFamily("kvc_router_reused_prompt_tokens", "Prompt tokens taken "
                                  "from the prompt token cache instead of tokenised",
                                  value=t.reused_tokens)


def hit_tiers(d: Decision, n_tokens: int, block_size: int) -> tuple[int, int, int]:
    """``d.hit_tokens`` split into (engine, store DRAM, store disk) tokens: the engine's
    leading resident blocks first, the rest loaded from the store, ``d.load_on_disk``
    objects of it from the disk tier. Each is >= 0 and they sum to ``d.hit_tokens`` (the
    engine share is capped there too: a fully resident prompt still computes one token)."""
    engine = min(d.local_blocks * block_size, n_tokens, d.hit_tokens)
    store = max(d.hit_tokens - engine, 0)
    disk = min(store, d.load_on_disk * block_size)
    return engine, store - disk, disk


class _StateCollector(Collector):
    """Gauges computed from the conductor's live state when scraped."""

    def __init__(self, conductor: Conductor) -> None:
        self.conductor = conductor

    def collect(self) -> Iterator[GaugeMetricFamily]:
        c = self.conductor
        now = c.clock()
        fams = {
            "healthy": GaugeMetricFamily("kvc_router_instance_healthy", "1 when in rotation",
                                         labels=["instance", "role"]),
            "queue": GaugeMetricFamily("kvc_router_instance_queue_seconds", "Predicted "
                                       "prefill work queued (T_queue)", labels=["instance"]),
            "decodes": GaugeMetricFamily("kvc_router_instance_decodes", "Decodes in flight "
                                         "through the router", labels=["instance"]),
            "running": GaugeMetricFamily("kvc_router_instance_running", "Engine's running "
                                         "requests (its /metrics)", labels=["instance"]),
            "waiting": GaugeMetricFamily("kvc_router_instance_waiting", "Engine's waiting "
                                         "requests (its /metrics)", labels=["instance"]),
            "kv": GaugeMetricFamily("kvc_router_instance_kv_usage", "Engine's KV cache "
                                    "usage (0..1)", labels=["instance"]),
            "resident": GaugeMetricFamily("kvc_router_instance_resident_blocks", "Blocks "
                                          "believed resident", labels=["instance"]),
            "corr": GaugeMetricFamily("kvc_router_instance_prefill_correction", "Actual / "
                                      "predicted prefill time (EWMA)", labels=["instance"]),
        }
        for inst in c.registry:
            n = inst.name
            fams["healthy"].add_metric([n, inst.spec.role], 1.0 if inst.healthy else 0.0)
            fams["queue"].add_metric([n], inst.queue_s(now))
            fams["decodes"].add_metric([n], float(inst.decodes))
            fams["running"].add_metric([n], inst.stats.running)
            fams["waiting"].add_metric([n], inst.stats.waiting)
            fams["kv"].add_metric([n], inst.stats.kv_usage)
            fams["resident"].add_metric([n], float(c.index.resident(inst.slot)))
            fams["corr"].add_metric([n], inst.correction)
        yield from fams.values()
        heat = GaugeMetricFamily("kvc_router_prefix_heat", "Decayed request rate of the "
                                 "hottest prefixes (by root block)", labels=["prefix"])
        reps = GaugeMetricFamily("kvc_router_prefix_replicas", "Instances holding each hot "
                                 "prefix", labels=["prefix"])
        for key, value in c.heat.top(TOP_PREFIXES, now):
            label = key.hex()[:16]
            heat.add_metric([label], value)
            reps.add_metric([label], float(c.replicas(key)))
        yield heat
        yield reps
        st = GaugeMetricFamily("kvc_router_store_queries", "store lookups made (TTL cache "
                               "misses: the shared index or a batch_residency call)")
        st.add_metric([], float(c.store.queries))
        yield st
