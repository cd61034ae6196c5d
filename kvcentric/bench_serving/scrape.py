"""The servers' prefix-cache counters from Prometheus ``/metrics``, before and after a run.

Counters are summed over their label sets per bare name. A server whose ``/metrics`` does
not answer is recorded as ``None`` and left out of the sums (the run does not fail).
``hit_tokens`` = the run's growth of every *hit* counter below, over all scraped servers:
vLLM's own prefix-cache hits plus its external (connector) hits, or SGLang's cached tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

HIT_COUNTERS = {
    "vllm:prefix_cache_hits_total": "local",
    "vllm:external_prefix_cache_hits_total": "external",
    "sglang:cached_tokens_total": "local",
}
QUERY_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:external_prefix_cache_queries_total",
                  "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
# the engine's own latency histograms (sum and count): what the engine did, apart from
# anything a router adds between it and the client
ENGINE_LATENCY = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds")
KVCENTRIC_PREFIX = "vllm:kvcentric_"


def parse(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {bare name: sum over label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] == "#":
            continue
        if "{" in line:  # label values may hold spaces: split after the closing brace
            name = line.split("{", 1)[0]
            rest = line.rsplit("}", 1)[1].split()
        else:
            name, *rest = line.split()
        try:
            v = float(rest[0])  # a trailing timestamp, if any, is ignored
        except (ValueError, IndexError):
            continue
        out[name] = out.get(name, 0.0) + v
    return out


def scrape(urls: Iterable[str], timeout_s: float = 10.0) -> dict[str, dict[str, float] | None]:
    """``/metrics`` of each base URL (parsed), None where it did not answer 200."""
    import httpx  # the router extra: imported where a request is made

    out: dict[str, dict[str, float] | None] = {}
    for url in urls:
        try:
            r = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s)
            out[url] = parse(r.text) if r.status_code == 200 else None
        except httpx.HTTPError:
            out[url] = None
    return out


def _interesting(name: str) -> bool:
    return (name in HIT_COUNTERS or name in QUERY_COUNTERS or name.startswith(KVCENTRIC_PREFIX)
            or name.removesuffix("_sum").removesuffix("_count") in ENGINE_LATENCY)


def engine_means_ms(total: dict[str, float]) -> dict[str, float | None]:
    """Mean engine-side TTFT and inter-token latency (ms) from a delta's ``total``; None
    where the engine recorded none."""
    out: dict[str, float | None] = {}
    for name, key in zip(ENGINE_LATENCY, ("engine_ttft_ms", "engine_itl_ms"), strict=True):
        n = total.get(name + "_count", 0.0)
        out[key] = 1000 * total.get(name + "_sum", 0.0) / n if n > 0 else None
    return out


def delta(before: dict[str, dict[str, float] | None],
          after: dict[str, dict[str, float] | None]) -> dict[str, Any]:
    """Per-server and total growth of the interesting counters, and ``hit_tokens``.

    ``hit_tokens`` is None when no server exposed any hit counter.
    """
    per: dict[str, dict[str, float]] = {}
    total: dict[str, float] = {}
    for url, a in after.items():
        b = before.get(url)
        if a is None or b is None:
            continue
        d = {k: a[k] - b.get(k, 0.0) for k in a if _interesting(k)}
        per[url] = d
        for k, v in d.items():
            total[k] = total.get(k, 0.0) + v
    present = [k for k in HIT_COUNTERS if k in total]
    hits = {src: sum(total[k] for k in present if HIT_COUNTERS[k] == src)
            for src in ("local", "external")}
    return {"per_server": per, "total": total,
            "hit_tokens": sum(hits.values()) if present else None,
            "hit_tokens_local": hits["local"] if present else None,
            "hit_tokens_external": hits["external"] if present else None,
            **engine_means_ms(total),
            "unreachable": sorted(u for u, v in after.items() if v is None)}
