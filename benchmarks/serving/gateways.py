"""Routers in front of the instances, each its own process group on 127.0.0.1.

- ``sglang:<policy>``: PyPI ``sglang-router`` (``cache_aware``, ``round_robin``, ...).
- ``kvcentric``: our router (``python -m router.cli serve --config FILE``), configured
  for the instances, their store and the benchmark's SLO.

:meth:`Gateway.stop` ends only the process group started here.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvcentric.testing.servers import free_port, stop_group


@dataclass
class Gateway:
    """One router process; ``url`` is its OpenAI base URL once :meth:`wait_ready` returns."""

    name: str
    cmd: list[str]
    port: int
    log_path: Path
    ready_path: str = "/health"
    ready_count: str | None = None  # a JSON list key whose entries must reach workers
    workers: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Gateway:
        out = open(self.log_path, "ab")  # the child keeps its own descriptor
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()
        return self

    def _ready(self) -> bool:
        r = httpx.get(self.url + self.ready_path, timeout=2)
        if r.status_code != 200:
            return False
        if self.ready_count is None:
            return True
        entries = r.json().get(self.ready_count) or []
        return sum(bool(e.get("healthy", True)) for e in entries) >= self.workers

    def wait_ready(self, timeout_s: float = 120.0) -> Gateway:
        """Block until the router answers and knows every worker as healthy; raise if the
        process exits or time runs out."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; "
                                   f"log: {self.log_path}")
            try:
                if self._ready():
                    return self
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.name} not ready in {timeout_s} s; log: {self.log_path}")

    def stop(self) -> None:
        stop_group(self.proc, 15.0)


def sglang_router(policy: str, worker_urls: Sequence[str], logs: Path) -> Gateway:
    """``sglang-router`` with ``policy`` over ``worker_urls`` (metrics on 127.0.0.1 too)."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--worker-urls", *worker_urls, "--policy", policy,
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    return Gateway(f"sglang-router-{policy}", cmd, port, logs / f"sglang-{policy}.log",
                   "/workers", "workers", len(worker_urls))


def kvcentric_router(model: str, tokenizer: str, worker_urls: Sequence[str],
                     store: dict[str, Any], slo_ttft_ms: float, slo_tpot_ms: float,
                     logs: Path, profile: str | None = None, dtype: str | None = None,
                     compute: str | None = None, reject: bool = True,
                     replication: bool = False) -> Gateway:
    """Our router over ``worker_urls`` (role ``both``, on one ``compute`` when they share
    a processor) sharing ``store``; the router's SLO is the benchmark's, so what it
    refuses (``reject``) is what it predicts would miss it anyway; ``replication``: hot
    prefixes warmed on idle instances (its defaults otherwise)."""
    port = free_port()
    cfg = {"model": model, "tokenizer": tokenizer, "listen": {"host": "127.0.0.1", "port": port},
           "instances": [{"url": u, "role": "both", "compute": compute} for u in worker_urls],
           "slo": {"ttft_ms": slo_ttft_ms, "tbt_ms": slo_tpot_ms, "reject": reject},
           "store": dict(store),
           "cost": {"profile": profile, "kv_dtype": dtype},
           "replication": {"enabled": replication}}
    path = logs / f"kvcentric-router-{port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "kvcentric.router.cli", "serve", "--config", str(path)]
    return Gateway("kvcentric-router", cmd, port, logs / "kvcentric-router.log",
                   "/instances", "instances", len(worker_urls))


def gateway_for(kind: str, worker_urls: Sequence[str], logs: Path,
                **router_kw: Any) -> Gateway | None:
    """The gateway an :class:`~benchmarks.serving.fleet.Arm` names (None: client-side RR)."""
    if kind == "client-rr":
        return None
    if kind.startswith("sglang:"):
        return sglang_router(kind.split(":", 1)[1], worker_urls, logs)
    if kind == "kvcentric":
        return kvcentric_router(worker_urls=worker_urls, logs=logs, **router_kw)
    raise ValueError(f"unknown gateway {kind!r}")
