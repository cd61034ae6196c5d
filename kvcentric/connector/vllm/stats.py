"""Connector statistics: collected per step in the scheduler and workers, summed by vLLM,
logged as "KV Transfer metrics" and exported as ``vllm:kvcentric_*`` Prometheus counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvcentric.connector.vllm.counters import FIELDS, Counters


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

    @classmethod
    def from_counters(cls, counters: Counters) -> KVCentricStats | None:
        """The counts ``counters`` collected since the last call (reset); None when
        nothing happened."""
        snap = counters.take()
        return None if snap is None else cls(data=snap)


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
