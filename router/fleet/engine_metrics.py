"""The few load figures the router reads from an engine's Prometheus ``/metrics`` page.

A vLLM ``/metrics`` page is ~700 lines (~60 KB: every histogram's buckets); the router polls
it for each instance every ``health.interval_s`` on its event loop. ``prometheus_client``'s
text parser walks it character by character in Python (tens of milliseconds per page):
per instance per second, a stall every request arriving meanwhile waits out.
:func:`parse_engine_metrics` reads only the lines of the series it needs (a prefix test
per line, labels parsed on one series only): well under a millisecond per page.

Text format handled (Prometheus exposition 0.0.4, what vLLM and SGLang serve):
``name{label="value",...} value [timestamp]`` or ``name value [timestamp]``; ``#`` lines
are comments. Samples of one series with different labels (one per engine of a
data-parallel server) are summed.

Series by engine (:data:`SERIES`): vLLM's ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` and the cache size in the
labels of ``vllm:cache_config_info`` (``num_gpu_blocks``, ``block_size``); SGLang's
``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage`` and its
cache in tokens, ``sglang:max_total_num_tokens`` (its page size is not on the page: the
router reads it from ``/server_info``), as ``sglang.srt.observability.metrics_collector``
names them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Series:
    """The names of the series the router reads, for one kind of engine."""

    running: str
    waiting: str
    kv_usage: str
    cache: str  # vLLM: an info series with the cache in its labels; SGLang: tokens

    @property
    def summed(self) -> tuple[str, str, str]:
        return self.running, self.waiting, self.kv_usage


SERIES = {
    "vllm": Series("vllm:num_requests_running", "vllm:num_requests_waiting",
                   "vllm:kv_cache_usage_perc", "vllm:cache_config_info"),
    "sglang": Series("sglang:num_running_reqs", "sglang:num_queue_reqs",
                     "sglang:token_usage", "sglang:max_total_num_tokens"),
}
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


@dataclass
class EngineStats:
    """Last ``/metrics`` snapshot of an engine. ``num_pages`` and ``page_size``: its KV
    cache (None until known); ``cache_tokens``: SGLang's cache in tokens, which the
    router turns into pages once it knows the server's page size."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    num_pages: int | None = None
    page_size: int | None = None
    cache_tokens: int | None = None


def parse_engine_metrics(text: str, kind: str = "vllm") -> EngineStats:
    """The load figures the router needs from the ``/metrics`` page of an engine of
    ``kind`` (a key of :data:`SERIES`).

    Missing series read as 0 (the cache as None); a line of a wanted series that
    does not parse raises ``ValueError`` (the caller keeps its previous snapshot).
    """
    names = SERIES[kind]
    wanted = (*names.summed, names.cache)
    stats = EngineStats()
    sums = dict.fromkeys(names.summed, 0.0)
    for line in text.splitlines():
        if not line.startswith(wanted):
            continue
        name, labels, value = _sample(line, names.cache if kind == "vllm" else None)
        if name in sums:
            sums[name] += value
        elif name == names.cache and kind == "vllm":
            pages, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
            if pages.isdigit() and size.isdigit():
                stats.num_pages, stats.page_size = int(pages), int(size)
        elif name == names.cache and math.isfinite(value) and value >= 1:
            stats.cache_tokens = (stats.cache_tokens or 0) + int(value)
    stats.running, stats.waiting = sums[names.running], sums[names.waiting]
    usage = sums[names.kv_usage]
    stats.kv_usage = usage if math.isfinite(usage) else 0.0
    return stats


def _sample(line: str, labelled: str | None) -> tuple[str, dict[str, str], float]:
    """``(name, labels, value)`` of one sample line (labels parsed for the series named
    ``labelled`` only); ``ValueError`` if malformed.

    Only the wanted names matter; a longer name sharing the prefix (e.g. a
    ``vllm:num_requests_running_total``) comes back under its own name and is ignored.
    """
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        end = line.rfind("}")
        if end < brace:
            raise ValueError(f"unterminated labels in metrics line {line[:120]!r}")
        name, body, rest = line[:brace], line[brace + 1:end], line[end + 1:]
        labels = dict(_LABEL.findall(body)) if name == labelled else {}
    else:
        name, _, rest = line.partition(" ")
        labels = {}
    fields = rest.split()
    if not fields:
        raise ValueError(f"no value in metrics line {line[:120]!r}")
    return name.strip(), labels, float(fields[0])
