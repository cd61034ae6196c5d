"""The Mooncake master's HTTP endpoints the backend reads: Prometheus metrics (cluster
bytes, keys, evictions) and the key dump (inspection only: it lists every key)."""

from __future__ import annotations

import urllib.request

from kvcentric.store.base import StoreUnavailable


def _get(url: str, timeout: float) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return str(r.read().decode())
    except OSError as exc:
        raise StoreUnavailable(f"mooncake master {url}: {exc}") from exc


def fetch_metrics(url: str, timeout: float) -> dict[str, float]:
    """Label-free samples of the Prometheus text at ``url`` as {name: value}."""
    out = {}
    for line in _get(url, timeout).splitlines():
        name, _, value = line.partition(" ")
        if line and line[0] != "#" and "{" not in name:
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def fetch_keys(metrics_url: str, timeout: float = 10.0) -> list[str]:
    """Every key the master holds (``/get_all_keys`` next to its ``/metrics``)."""
    return _get(metrics_url.rsplit("/", 1)[0] + "/get_all_keys", timeout).split()
