"""An emulated engine's ``/metrics`` page, named and shaped as vLLM's (or SGLang's).

Gauges the router reads (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info`` with ``block_size`` and
``num_gpu_blocks``), the counters the benchmarks scrape (prompt and generation tokens,
prefix-cache queries and hits, external (connector) queries and hits) and vLLM's latency
histograms (TTFT, inter-token, end-to-end, queue time) with vLLM's buckets.
:func:`render_sglang` is an SGLang server's page as far as a router reads it: the gauges
``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage`` and
``sglang:max_total_num_tokens`` (``sglang.srt.observability.metrics_collector``'s names,
labels ``model_name`` and ``engine_type`` as it sets them), and its token counters.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .engine import EngineCore

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.total += v
        self.n += 1

    def render(self, name: str, labels: str) -> list[str]:
        out = [f"# HELP {name} Histogram of {name.split(':', 1)[1]}.", f"# TYPE {name} histogram"]
        cum = 0
        for b, c in zip(self.buckets, self.counts):
            cum += c
            out.append(f'{name}_bucket{{{labels},le="{b}"}} {float(cum)}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(self.n)}')
        out.append(f"{name}_count{{{labels}}} {float(self.n)}")
        out.append(f"{name}_sum{{{labels}}} {self.total}")
        return out


@dataclass
class Latencies:
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))


def render(core: EngineCore, lat: Latencies, model: str) -> str:
    """The page for one engine (``engine="0"``, ``model_name`` = the served name)."""
    lab = f'engine="0",model_name="{model}"'
    k = core.counters
    lines = []

    def gauge(name: str, value: float) -> None:
        lines.extend([f"# HELP vllm:{name} {name}.", f"# TYPE vllm:{name} gauge",
                      f"vllm:{name}{{{lab}}} {float(value)}"])

    def counter(name: str, value: float) -> None:
        lines.extend([f"# HELP vllm:{name} {name}.", f"# TYPE vllm:{name} counter",
                      f"vllm:{name}{{{lab}}} {float(value)}"])

    gauge("num_requests_running", len(core.running))
    gauge("num_requests_waiting", len(core.waiting))
    gauge("kv_cache_usage_perc", core.cache.kv_usage)
    lines += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
              "# TYPE vllm:cache_config_info gauge",
              f'vllm:cache_config_info{{block_size="{core.p.page_size}",engine="0",'
              f'enable_prefix_caching="True",num_gpu_blocks="{core.cache.capacity}"}} 1.0']
    counter("prompt_tokens_total", k.prompt_tokens)
    counter("generation_tokens_total", k.generation_tokens)
    counter("prefix_cache_queries_total", k.prefix_cache_queries)
    counter("prefix_cache_hits_total", k.prefix_cache_hits)
    if core.connector is not None:
        counter("external_prefix_cache_queries_total", k.external_prefix_cache_queries)
        counter("external_prefix_cache_hits_total", k.external_prefix_cache_hits)
    counter("request_success_total", k.finished)
    for name, h in (("time_to_first_token_seconds", lat.ttft),
                    ("inter_token_latency_seconds", lat.itl),
                    ("e2e_request_latency_seconds", lat.e2e),
                    ("request_queue_time_seconds", lat.queue)):
        lines += h.render(f"vllm:{name}", lab)
    return "\n".join(lines) + "\n"


def render_sglang(core: EngineCore, model: str, engine_type: str) -> str:
    """An SGLang server's page for one engine; ``engine_type``: ``unified``, ``prefill``
    or ``decode`` (its disaggregation mode, as SGLang labels it)."""
    lab = f'engine_type="{engine_type}",model_name="{model}"'
    lines = []

    def sample(name: str, kind: str, value: float) -> None:
        lines.extend([f"# HELP sglang:{name} {name}.", f"# TYPE sglang:{name} {kind}",
                      f"sglang:{name}{{{lab}}} {float(value)}"])

    sample("num_running_reqs", "gauge", len(core.running))
    sample("num_queue_reqs", "gauge", len(core.waiting))
    sample("token_usage", "gauge", core.cache.kv_usage)
    sample("max_total_num_tokens", "gauge", core.cache.capacity * core.p.page_size)
    sample("prompt_tokens_total", "counter", core.counters.prompt_tokens)
    sample("generation_tokens_total", "counter", core.counters.generation_tokens)
    return "\n".join(lines) + "\n"
