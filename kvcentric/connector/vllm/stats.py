"""Connector statistics: collected per step in the scheduler and workers, summed by vLLM,
logged as "KV Transfer metrics" and exported as ``vllm:kvcentric_*`` Prometheus counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# name -> help text; every field is a counter summed over steps and workers
FIELDS = {
    "lookups": "Prefix lookups in the store",
    "lookup_seconds": "Time the scheduler spent in store lookups (blocks scheduling)",
    "hit_tokens": "Prompt tokens found in the store (scheduler side)",
    "tail_hits": "Hits that load a tail object (the prompt's partial last block)",
    "saved_tails": "Tail objects planned for saving (prefill end; last token with "
                   "save_decode)",
    "loaded_blocks": "Stored blocks loaded into the engine",
    "loaded_bytes": "Bytes loaded from the store",
    "load_seconds": "Time spent in layer loads: ranged fetches and copies (worker; "
                    "overlaps compute when async)",
    "fetch_seconds": "Time the worker spent leasing stored objects at step start (blocks "
                     "the step; a streamed lease moves its bytes in the layer loads)",
    "load_wait_seconds": "Time the forward pass waited for layer loads (worker)",
    "load_errors": "Stored blocks that failed to load and were recomputed",
    "saved_blocks": "Blocks written to the store",
    "saved_bytes": "Bytes written to the store",
    "save_seconds": "Time spent in save copies (worker; overlaps compute when async)",
    "commit_seconds": "Time the worker spent reserving and committing saves (blocks the "
                      "step)",
    "skipped_blocks": "Blocks not saved: already stored or no space",
}


@dataclass
class KVCentricStats(KVConnectorStats):
    """Counters since the last ``get_kv_connector_stats`` call (a plain dict payload)."""

    def __post_init__(self) -> None:
        for name in FIELDS:
            self.data.setdefault(name, 0)

    def add(self, **inc: float) -> None:
        for name, value in inc.items():
            self.data[name] += value

    def reset(self) -> None:
        self.data = dict.fromkeys(FIELDS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVCentricStats:
        for name in FIELDS:
            self.data[name] += other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data[k] for k in FIELDS}
        for kind, nbytes in (("load", "loaded_bytes"), ("save", "saved_bytes")):
            secs = self.data[f"{kind}_seconds"]
            out[f"{kind}_gbps"] = round(self.data[nbytes] / secs / 1e9, 2) if secs else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in FIELDS)

    def take(self) -> KVCentricStats | None:
        """Return a copy holding the current counts and reset; None when nothing happened."""
        if self.is_empty():
            return None
        snap = KVCentricStats(data=dict(self.data))
        self.reset()
        return snap


class KVCentricPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per field, labelled per engine."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, doc in FIELDS.items():
            counter = self._counter_cls(name=f"vllm:kvcentric_{name}", documentation=doc,
                                        labelnames=labelnames)
            self._counters[name] = {idx: counter.labels(*vals)
                                    for idx, vals in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name in FIELDS:
            value = transfer_stats_data.get(name, 0)
            if value:
                self._counters[name][engine_idx].inc(value)
