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
    # the disk tier (docs/store.md §Disk tier); used_bytes/capacity_bytes above are DRAM's
    "dram_objects": ("dram_objects", "Committed objects with a DRAM copy", False),
    "dirty_bytes": ("dram_dirty_bytes", "DRAM bytes with no disk copy yet", False),
    "demoting": ("demotions_in_flight", "Disk writes queued or running", False),
    "disk_objects": ("disk_objects", "Objects with a complete disk copy", False),
    "disk_used_bytes": ("disk_used_bytes", "Bytes the disk tier's files take", False),
    "disk_capacity_bytes": ("disk_capacity_bytes", "Disk tier capacity bound in bytes", False),
    "dram_hits": ("dram_hits_total", "Objects read from DRAM", True),
    "disk_hits": ("disk_hits_total", "Objects read from the disk tier", True),
    "demotions": ("demotions_total", "Objects written to the disk tier", True),
    "promotions": ("promotions_total", "Disk objects copied back into DRAM by a read", True),
    "dram_evictions": ("dram_evictions_total", "Objects that left DRAM", True),
    "disk_evictions": ("disk_evictions_total", "Objects removed from disk for space", True),
    "dropped_undemoted": ("dropped_undemoted_total",
                          "Objects dropped from DRAM with no disk copy (the disk had no room)",
                          True),
    "put_waits": ("put_waits_total", "Reserve requests held back until demotion made room",
                  True),
    "put_wait_ms": ("put_wait_milliseconds_total", "Time held-back reserve requests waited",
                    True),
    "refused_undemoted": ("refused_undemoted_total", "Objects refused while the disk tier had "
                          "room but demotion had not made any yet", True),
    "disk_write_bytes": ("disk_write_bytes_total", "Bytes written to the disk tier", True),
    "disk_read_bytes": ("disk_read_bytes_total", "Bytes of disk objects leased to readers",
                        True),
    "disk_full": ("disk_full_total", "Demotions refused for lack of disk space", True),
    "disk_errors": ("disk_errors_total", "Demotions failed with I/O errors", True),
    "disk_corrupt": ("disk_corrupt_total", "Disk copies found corrupt by a reader", True),
    "disk_missing": ("disk_missing_total", "Disk copies whose file was gone", True),
    "recovered": ("disk_recovered_total", "Objects recovered from disk at start", True),
    "recovery_dropped": ("disk_recovery_dropped_total",
                         "Torn or corrupt files deleted at start", True),
}


def log_line(stats: Mapping[str, int]) -> str:
    """``Storage: 26.96 / 30.00 GB | Keys: 219474 | ...`` (docs/store.md §Contract, "Stats"),
    then the disk tier's part when the store has one."""
    line = (
        f"Storage: {stats['used_bytes'] / GB:.2f} / {stats['capacity_bytes'] / GB:.2f} GB"
        f" | Keys: {stats['keys']} | Hits: {stats['hits']} | Misses: {stats['misses']}"
        f" | Puts: {stats['puts']} | Gets: {stats['gets']} | Evictions: {stats['evictions']}"
    )
    if "disk_capacity_bytes" in stats:
        line += (
            f" | Disk: {stats['disk_used_bytes'] / GB:.2f} /"
            f" {stats['disk_capacity_bytes'] / GB:.2f} GB, {stats['disk_objects']} objects"
            f" | DRAM/disk hits: {stats['dram_hits']}/{stats['disk_hits']}"
            f" | Demoted: {stats['demotions']} | Promoted: {stats['promotions']}"
            f" | Written/read: {stats['disk_write_bytes'] / GB:.2f}/"
            f"{stats['disk_read_bytes'] / GB:.2f} GB"
            f" | Dropped undemoted: {stats['dropped_undemoted']}"
            f" | Puts held/refused: {stats['put_waits']}/{stats['refused_undemoted']}"
        )
    return line


def prometheus_text(stats: Mapping[str, int], store: str, prefix: str = "kvcentric_store") -> bytes:
    """Render ``stats`` in the Prometheus text exposition format, labelled by store name."""
    reg = CollectorRegistry()
    for name, (suffix, help_text, _) in _METRICS.items():
        if name in stats:
            g = Gauge(f"{prefix}_{suffix}", help_text, ["store"], registry=reg)
            g.labels(store=store).set(stats[name])
    return generate_latest(reg)
