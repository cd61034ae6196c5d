"""``kvcentric store exporter``: a local store's statistics as a Prometheus endpoint.

    kvcentric store exporter [--name N] [--runtime-dir D] [--host 127.0.0.1] [--port 9464]

The local store's coordinator speaks only over its unix socket, so Prometheus cannot
scrape it; this process asks it for ``stats`` on every scrape and serves
``kvcentric_store_*`` (the same names as ``kvcentric store stats --prometheus``, counters
typed as counters) plus ``kvcentric_store_up`` (0 while the coordinator does not answer).
It never starts a coordinator and never maps the arena's pages in. Mooncake needs no
exporter: scrape ``mooncake_master``'s own metrics port.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcentric.config import StoreConfig
from kvcentric.store import KVStore, StoreUnavailable, open_store
from kvcentric.store.backends import passive_config
from kvcentric.store.metrics import _METRICS

PREFIX = "kvcentric_store"


class StoreCollector(Collector):
    """Reads one local store's stats at scrape time (one client, reopened after a loss)."""

    def __init__(self, cfg: StoreConfig) -> None:
        self.cfg = passive_config(cfg, 2.0)
        self._store: KVStore | None = None
        self._lock = threading.Lock()

    def _stats(self) -> dict[str, Any] | None:
        with self._lock:
            try:
                if self._store is None:
                    self._store = open_store(self.cfg)
                return self._store.stats()
            except (StoreUnavailable, OSError, ValueError):
                if self._store is not None:
                    self._store.close()
                    self._store = None
                return None

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        up = GaugeMetricFamily(f"{PREFIX}_up", "1 when the store answered this scrape",
                               labels=["store"])
        up.add_metric([self.cfg.name], 0.0 if stats is None else 1.0)
        yield up
        if stats is None:
            return
        for name, (suffix, help_text, is_counter) in _METRICS.items():
            if name not in stats:
                continue
            fam: GaugeMetricFamily | CounterMetricFamily
            if is_counter:
                fam = CounterMetricFamily(f"{PREFIX}_{suffix.removesuffix('_total')}",
                                          help_text, labels=["store"])
            else:
                fam = GaugeMetricFamily(f"{PREFIX}_{suffix}", help_text, labels=["store"])
            fam.add_metric([self.cfg.name], float(stats[name]))
            yield fam

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None


def serve(cfg: StoreConfig, host: str, port: int) -> int:
    """Serve ``/metrics`` on ``host:port`` until SIGTERM/SIGINT."""
    registry = CollectorRegistry(auto_describe=False)
    collector = StoreCollector(cfg)
    registry.register(collector)
    server, thread = start_http_server(port, addr=host, registry=registry)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"store {cfg.name!r} metrics on http://{host}:{port}/metrics", flush=True)
    stop.wait()
    server.shutdown()
    thread.join(5)
    collector.close()
    return 0
