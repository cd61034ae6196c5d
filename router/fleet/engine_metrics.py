"""The few load figures the router reads from an engine's Prometheus ``/metrics`` page.

A vLLM ``/metrics`` page is ~700 lines (~60 KB: every histogram's buckets); the router polls
it for each instance every ``health.interval_s`` on its event loop. ``prometheus_client``'s
text parser walks it character by character in Python (tens of milliseconds per page):
per instance per second, a stall every request arriving meanwhile waits out.
:func:`parse_engine_metrics` reads only the lines of the four series it needs (a prefix test
per line, labels parsed on one series only): well under a millisecond per page.

Text format handled (Prometheus exposition 0.0.4, what vLLM serves):
``name{label="value",...} value [timestamp]`` or ``name value [timestamp]``; ``#`` lines
are comments. Samples of one series with different labels (one per engine of a
data-parallel server) are summed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
_SUMMED = (RUNNING, WAITING, KV_USAGE)
_WANTED = (*_SUMMED, CACHE_CONFIG)
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


@dataclass
class EngineStats:
    """Last ``/metrics`` snapshot of an engine (vLLM names)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    num_pages: int | None = None
    page_size: int | None = None


def parse_engine_metrics(text: str) -> EngineStats:
    """The load figures the router needs from a vLLM ``/metrics`` page.

    Missing series read as 0 (pages and page size as None); a line of a wanted series that
    does not parse raises ``ValueError`` (the caller keeps its previous snapshot).
    """
    stats = EngineStats()
    sums = dict.fromkeys(_SUMMED, 0.0)
    for line in text.splitlines():
        if not line.startswith(_WANTED):
            continue
        name, labels, value = _sample(line)
        if name in sums:
            sums[name] += value
        elif name == CACHE_CONFIG:
            pages, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
            if pages.isdigit() and size.isdigit():
                stats.num_pages, stats.page_size = int(pages), int(size)
    stats.running, stats.waiting = sums[RUNNING], sums[WAITING]
    usage = sums[KV_USAGE]
    stats.kv_usage = usage if math.isfinite(usage) else 0.0
    return stats


def _sample(line: str) -> tuple[str, dict[str, str], float]:
    """``(name, labels, value)`` of one sample line; ``ValueError`` if malformed.

    Only names in ``_WANTED`` matter; a longer name sharing the prefix (e.g. a
    ``vllm:num_requests_running_total``) comes back under its own name and is ignored.
    """
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        end = line.rfind("}")
        if end < brace:
            raise ValueError(f"unterminated labels in metrics line {line[:120]!r}")
        name, body, rest = line[:brace], line[brace + 1:end], line[end + 1:]
        labels = dict(_LABEL.findall(body)) if name == CACHE_CONFIG else {}
    else:
        name, _, rest = line.partition(" ")
        labels = {}
    fields = rest.split()
    if not fields:
        raise ValueError(f"no value in metrics line {line[:120]!r}")
    return name.strip(), labels, float(fields[0])
