"""Store statistics as a log line and as Prometheus metrics."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Gauge, generate_latest

GB = 1e9

# stat name -> (prometheus suffix, help, is_counter)
_METRICS = {
    "used_bytes": ("used_bytes", "Bytes stored", False),
    "capacity_bytes": ("capacity_bytes", "Hard capacity bound in bytes", False),
    "keys": ("keys", "Committed objects", False),
    "pending": ("pending_writes", "Objects allocated but not committed", False),
    "leases": ("leases", "Open read leases", False),
    "hits": ("hits_total", "Objects found by reads", True),
    "misses": ("misses_total", "Objects requested by reads and not found", True),
    "puts": ("puts_total", "Objects committed", True),
    "put_bytes": ("put_bytes_total", "Bytes committed", True),
    "gets": ("gets_total", "Objects read", True),
    "get_bytes": ("get_bytes_total", "Bytes read", True),
    "evictions": ("evictions_total", "Objects evicted", True),
    "rejected_puts": ("rejected_puts_total", "Puts refused for lack of space", True),
    "expired_leases": ("expired_leases_total",
                       "Read leases reclaimed after lease_ttl_s (a hung client)", True),
    "shared_index": ("shared_index_enabled",
                     "1 while clients answer lookups from the shared-memory index", False),
}


def log_line(stats: Mapping[str, int]) -> str:
    """``Storage: 26.96 / 30.00 GB | Keys: 219474 | ...`` (the format of ARCHITECTURE §4)."""
    return (
        f"Storage: {stats['used_bytes'] / GB:.2f} / {stats['capacity_bytes'] / GB:.2f} GB"
        f" | Keys: {stats['keys']} | Hits: {stats['hits']} | Misses: {stats['misses']}"
        f" | Puts: {stats['puts']} | Gets: {stats['gets']} | Evictions: {stats['evictions']}"
    )


def prometheus_text(stats: Mapping[str, int], store: str, prefix: str = "kvcentric_store") -> bytes:
    """Render ``stats`` in the Prometheus text exposition format, labelled by store name."""
    reg = CollectorRegistry()
    for name, (suffix, help_text, _) in _METRICS.items():
        if name in stats:
            g = Gauge(f"{prefix}_{suffix}", help_text, ["store"], registry=reg)
            g.labels(store=store).set(stats[name])
    return generate_latest(reg)
