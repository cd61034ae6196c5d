"""Statistics of the SGLang backend, handed to SGLang through ``get_stats()``.

SGLang's storage metrics collector expects a ``StorageMetrics`` (four lists since the
last call: pages and GiB/s per prefetch and per backup); we fill those when SGLang's
storage metrics are on (``--enable-metrics``), and always keep cumulative counters,
attached to the returned object as ``.kvcentric`` (a dict; :data:`COUNTERS`, among them
``integrity_errors``).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any

COUNTERS = {
    "exists_pages": "pages looked up with batch_exists",
    "exists_hits": "pages found by lookups (leading runs)",
    "get_pages": "pages asked to load",
    "get_hits": "pages loaded into the host pool",
    "get_bytes": "bytes loaded",
    "get_seconds": "time spent loading",
    "set_pages": "pages asked to store",
    "set_ok": "pages stored (or already present)",
    "set_failed": "pages not stored (no space, store down)",
    "set_skipped": "pages not written: another TP rank writes MLA KV",
    "set_bytes": "bytes written or already present",
    "set_seconds": "time spent storing",
    "errors": "store errors turned into misses",
    "integrity_errors": "stored objects whose header named another page, rank, layout or "
                        "format (or of another size): read as misses",
}

_SGLANG_METRICS = "sglang.srt.observability.metrics_collector"


@dataclass
class StorageMetricsCompat:
    """Same fields as SGLang's ``StorageMetrics``; used when SGLang's metrics module is not
    loaded in this process (then nothing of SGLang reads them but our callers)."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


def _metrics_class() -> type:
    # SGLang imports its collector wherever storage metrics are on; importing it here
    # would drag in SGLang's model configs, so use it only when already loaded.
    mod = sys.modules.get(_SGLANG_METRICS)
    cls = getattr(mod, "StorageMetrics", None)
    return cls if isinstance(cls, type) else StorageMetricsCompat


class SGLangStats:
    """Thread-safe counters; SGLang calls the backend from its prefetch and backup threads."""

    def __init__(self, per_call: bool) -> None:
        self.per_call = per_call
        self._lock = threading.Lock()
        self._counts: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self._calls: dict[str, list[Any]] = {"prefetch_pgs": [], "backup_pgs": [],
                                             "prefetch_bandwidth": [], "backup_bandwidth": []}

    def add(self, **inc: float) -> None:
        with self._lock:
            for name, value in inc.items():
                self._counts[name] += value

    def record(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        """One prefetch (``kind="prefetch"``) or backup call that moved ``pages``."""
        if not self.per_call or pages <= 0:
            return
        with self._lock:
            self._calls[f"{kind}_pgs"].append(pages)
            self._calls[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / (1 << 30))

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)

    def drain(self) -> Any:
        """A ``StorageMetrics`` with the per-call lists since the last drain, plus
        ``.kvcentric``, the cumulative counters."""
        with self._lock:
            calls = {k: list(v) for k, v in self._calls.items()}
            for v in self._calls.values():
                v.clear()
            counts = dict(self._counts)
        metrics = _metrics_class()()
        for name, values in calls.items():
            getattr(metrics, name).extend(values)
        metrics.kvcentric = counts
        return metrics
