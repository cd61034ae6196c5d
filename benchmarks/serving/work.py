"""Did a connector arm do the work it is timed for? Counted by the side that did it.

A peer arm that saved or loaded nothing is not a cheap arm but a broken one (a connector
that fails to load falls back to recompute and still answers). So every connector arm's
saves and loads are read from its own accounting, never from ours:

- ours (``kvc``, ``kvcentric``, ``kvcentric_whole_get``): the connector's counters on
  vLLM's ``/metrics`` (:data:`OURS`: blocks saved, blocks loaded);
- ``lmcache``: the ``lmcache server``'s own ``/metrics`` (LMCache's OpenTelemetry counters,
  :data:`LMCACHE`: chunks written to its L1; chunks read from its L1 for the engine, or
  counted as loaded into it, whichever is larger: with vLLM driving the transfer, as on
  CPU, LMCache 0.5.6 publishes only the L1 reads);
- ``mooncake_store_connector``: the Mooncake master's ``/metrics`` (:data:`MOONCAKE`:
  objects whose put completed, replica lookups of gets) and vLLM's own count of tokens a
  connector provided (``vllm:external_prefix_cache_hits_total``).

:class:`Work` is one reading (cumulative counters); ``after - before`` is what happened
in between, and :func:`invalid` says why that is not the work an arm was timed for (or
None).
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

OURS = ("vllm:kvcentric_saved_blocks_total", "vllm:kvcentric_loaded_blocks_total")
LMCACHE = ("lmcache_mp_l1_write", "lmcache_mp_l1_read", "lmcache_mp_num_chunks_loaded")
MOONCAKE = ("master_put_end_requests_total", "master_batch_put_end_items_total",
            "master_get_replica_list_requests_total",
            "master_batch_get_replica_list_items_total")
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"


@dataclass(frozen=True)
class Work:
    """Cumulative saves and loads of one arm, in ``unit``s, as ``source`` counts them."""

    saved: float
    loaded: float
    unit: str
    source: str

    def __sub__(self, before: Work) -> Work:
        return Work(self.saved - before.saved, self.loaded - before.loaded, self.unit,
                    self.source)

    def as_dict(self) -> dict[str, float | str]:
        return {"saved": self.saved, "loaded": self.loaded, "unit": self.unit,
                "source": self.source}


def invalid(done: Work, saves: bool, loads: bool) -> str | None:
    """Why ``done`` (an ``after - before``) is not the work of an arm timed for saving
    (``saves``) and/or loading (``loads``), or None when it did both."""
    missing = [what for what, want, got in (("saved", saves, done.saved),
                                            ("loaded", loads, done.loaded)) if want and got <= 0]
    if not missing:
        return None
    return f"{' and '.join(missing)} nothing by {done.source}"


def prometheus_sums(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: sum over its label sets} (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = re.match(r"([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m is None:
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + v
    return out


def fetch(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """:func:`prometheus_sums` of the page at ``url``."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return prometheus_sums(r.read().decode())


def _counter(m: Mapping[str, float], stem: str) -> float:
    """The counter named ``stem`` whatever suffixes its exporter added (OpenTelemetry's
    Prometheus exporter appends the unit and ``_total``): the sum of every metric whose
    name is ``stem`` or ``stem_<unit>_total`` / ``stem_total``."""
    pat = re.compile(rf"{re.escape(stem)}(_[a-z]+)?_total$|{re.escape(stem)}$")
    return sum(v for k, v in m.items() if pat.match(k) and not k.endswith("_created"))


def ours(vllm_metrics: Mapping[str, float], block_tokens: int) -> Work:
    """Our connector's saved and loaded blocks, as tokens (``block_tokens`` a block)."""
    saved, loaded = (vllm_metrics.get(k, 0.0) * block_tokens for k in OURS)
    return Work(saved, loaded, "tokens", "the kvcentric connector's counters")


def lmcache(server_metrics: Mapping[str, float], chunk_tokens: int) -> Work:
    """LMCache's own counters, as tokens (``chunk_tokens`` a chunk): chunks written to
    the server's L1 (saved); chunks read from its L1 or loaded into the engine, the larger
    (loaded)."""
    saved, read, loaded = (_counter(server_metrics, stem) * chunk_tokens for stem in LMCACHE)
    return Work(saved, max(read, loaded), "tokens", "the lmcache server's counters")


def mooncake(master_metrics: Mapping[str, float], vllm_metrics: Mapping[str, float]) -> Work:
    """Objects the Mooncake master completed puts of (saved, objects) and tokens vLLM says
    a connector provided (loaded, tokens): unit ``objects / tokens``."""
    saved = sum(master_metrics.get(k, 0.0) for k in MOONCAKE[:2])
    return Work(saved, vllm_metrics.get(EXTERNAL_HITS, 0.0), "objects / tokens",
                "the Mooncake master's puts and vLLM's external hits")
