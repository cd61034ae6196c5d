"""Routers in front of the instances, each its own process group on 127.0.0.1.

- ``sglang:<policy>``: PyPI ``sglang-router`` (``cache_aware``, ``round_robin``, ...).
- ``smg:<policy>``: the SGLang Model Gateway, PyPI ``smg`` (``cache_aware``,
  ``round_robin``, ...), ``python -m smg.launch_router`` (= ``smg launch``) in HTTP mode.
- ``vllm-router:<policy>``: PyPI ``vllm-router`` (``cache_aware``: its prefix tree over
  the request text, ``round_robin``, ...; ``kv_aware`` would need the engines' ZMQ KV
  events, which the instances here do not publish).
- ``kvcentric``: our router (``python -m router.cli serve --config FILE``), configured
  for the instances, their store and the benchmark's SLO.

``smg`` and ``vllm-router`` run from their own virtual environments,
``.peers/<name>`` at the repository root, pinned in :data:`PEERS` (:func:`peer_python`
makes one when it is missing; ``make compare`` does the same), so their dependencies
never touch the project's. Every listener of every router is on 127.0.0.1: smg binds
its router and its Prometheus listener to 0.0.0.0 unless told otherwise, and both peers
open a Prometheus listener on port 29000 by default, so host and port are named here.
Readiness: ``GET /workers`` lists the workers with ``is_healthy`` (smg answers before it
has registered them, listing only those registered: the count must reach them all).

:meth:`Gateway.stop` ends only the process group started here.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.lib.paths import ROOT
from kvcentric.testing.servers import free_port, stop_group

# Peer routers with a virtual environment each, .peers/<name> (the Makefile's compare
# target installs the same pins).
PEERS = {"smg": "smg==1.13.0", "vllm-router": "vllm-router==0.1.17"}
PEERS_DIR = ROOT / ".peers"


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
    cpus: tuple[int, ...] | None = None  # CPUs the process may run on (None: any)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Gateway:
        out = open(self.log_path, "ab")  # the child keeps its own descriptor
        cpus = self.cpus
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cpus))
                                     if cpus else None)
        out.close()
        return self

    def _ready(self) -> bool:
        r = httpx.get(self.url + self.ready_path, timeout=2)
        if r.status_code != 200:
            return False
        if self.ready_count is None:
            return True
        entries = r.json().get(self.ready_count) or []
        return sum(bool(e.get("is_healthy", e.get("healthy", True)))
                   for e in entries) >= self.workers

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


def _installed(python: Path, dist: str) -> str | None:
    """The version of ``dist`` that ``python`` imports, None if none (or no ``python``)."""
    if not python.exists():
        return None
    r = subprocess.run([str(python), "-c", "import importlib.metadata as m, sys; "
                        "print(m.version(sys.argv[1]))", dist],
                       capture_output=True, text=True, timeout=60)
    return r.stdout.strip() if r.returncode == 0 else None


def peer_python(name: str, requirement: str | None = None) -> Path:
    """The Python of peer router ``name``'s own virtual environment, ``.peers/<name>``,
    made (and ``requirement``, by default ``PEERS[name]``, ``dist==version``, installed in
    it) when missing or at another version. Raises RuntimeError with pip's last words when
    that fails (offline, say)."""
    req = requirement or PEERS[name]
    dist, _, version = req.partition("==")
    venv = PEERS_DIR / name
    python = venv / "bin" / "python"
    PEERS_DIR.mkdir(exist_ok=True)
    with open(PEERS_DIR / f"{name}.lock", "w") as lock:  # one installer at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        have = _installed(python, dist)
        if have is not None and (not version or have == version):
            return python
        steps = [] if python.exists() else [[sys.executable, "-m", "venv", str(venv)]]
        steps.append([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                      req])
        for cmd in steps:
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
            except subprocess.TimeoutExpired as e:
                raise RuntimeError(f"cannot install {req} in {venv}: timed out") from e
            if r.returncode != 0:
                raise RuntimeError(f"cannot install {req} in {venv}: {' '.join(cmd[:4])} ... "
                                   f"exited {r.returncode}: {(r.stderr or r.stdout)[-1500:]}")
    return python


def smg_router(policy: str, worker_urls: Sequence[str], logs: Path,
               tokenizer: str | None = None) -> Gateway:
    """The SGLang Model Gateway (``smg``, from ``.peers/smg``) with ``policy`` over
    ``worker_urls``, HTTP mode; router and metrics on 127.0.0.1 (smg's defaults: 0.0.0.0).
    HTTP-mode routing needs no tokenizer (cache_aware matches request text): it gets the
    local folder ``tokenizer`` when there is one, else it loads none (never the Hub)."""
    port = free_port()
    cmd = [str(peer_python("smg")), "-m", "smg.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--worker-urls", *worker_urls, "--policy", policy,
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           *(["--tokenizer-path", tokenizer] if tokenizer else ["--disable-tokenizer-autoload"])]
    return Gateway(f"smg-{policy}", cmd, port, logs / f"smg-{policy}.log",
                   "/workers", "workers", len(worker_urls))


def vllm_router(policy: str, worker_urls: Sequence[str], logs: Path) -> Gateway:
    """``vllm-router`` (from ``.peers/vllm-router``) with ``policy`` over ``worker_urls``;
    its Prometheus listener (on by default, port 29000) on a free port of 127.0.0.1. It
    listens only once every worker answers ``/health``."""
    port = free_port()
    cmd = [str(peer_python("vllm-router")), "-m", "vllm_router.launch_router",
           "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
           "--policy", policy, "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(free_port())]
    return Gateway(f"vllm-router-{policy}", cmd, port, logs / f"vllm-router-{policy}.log",
                   "/workers", "workers", len(worker_urls))


def kvcentric_router(model: str, tokenizer: str, worker_urls: Sequence[str],
                     store: dict[str, Any] | None, slo_ttft_ms: float, slo_tpot_ms: float,
                     logs: Path, profile: str | None = None, dtype: str | None = None,
                     compute: str | None = None, reject: bool = True,
                     replication: bool = False, health_s: float | None = None,
                     instances: Sequence[dict[str, Any]] | None = None,
                     extra: dict[str, Any] | None = None, tag: str = "",
                     policy: str = "algorithm1") -> Gateway:
    """Our router over ``worker_urls`` (role ``both``, on one ``compute`` when they share
    a processor) sharing ``store``; the router's SLO is the benchmark's, so what it
    refuses (``reject``) is what it predicts would miss it anyway; ``replication``: hot
    prefixes warmed on idle instances; ``health_s``: its health and metrics poll interval
    (its defaults otherwise). ``instances``: the config's instance entries instead
    (roles, KV event endpoints); ``extra``: config sections merged over the rest;
    ``tag``: tells several routers' files apart; ``policy``: its routing policy
    (:data:`kvcentric.router.policies.POLICIES`)."""
    port = free_port()
    cfg: dict[str, Any] = {
           "model": model, "tokenizer": tokenizer, "listen": {"host": "127.0.0.1", "port": port},
           "instances": [dict(i) for i in instances] if instances is not None else
                        [{"url": u, "role": "both", "compute": compute} for u in worker_urls],
           "slo": {"ttft_ms": slo_ttft_ms, "tbt_ms": slo_tpot_ms, "reject": reject},
           "store": dict(store) if store is not None else None,
           "cost": {"profile": profile, "kv_dtype": dtype},
           "replication": {"enabled": replication}, "policy": policy}
    if health_s is not None:
        cfg["health"] = {"interval_s": health_s}
    for section, values in (extra or {}).items():
        cfg[section] = ({**cfg[section], **values} if isinstance(values, dict)
                        and isinstance(cfg.get(section), dict) else values)
    path = logs / f"kvcentric-router-{port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "kvcentric.router.cli", "serve", "--config", str(path)]
    return Gateway("kvcentric-router", cmd, port, logs / f"kvcentric-router{tag}.log",
                   "/instances", "instances", len(cfg["instances"]))


# the peer routers, by the name before ``:POLICY`` in a gateway kind:
# (policy, worker URLs, logs folder, tokenizer folder or None) -> its gateway
PEER_ROUTERS: dict[str, Callable[[str, Sequence[str], Path, str | None], Gateway]] = {
    "vllm-router": lambda policy, urls, logs, tok: vllm_router(policy, urls, logs),
    "smg": smg_router,
    "sglang": lambda policy, urls, logs, tok: sglang_router(policy, urls, logs),
}


def peer_name(kind: str) -> str | None:
    """The peer router a gateway kind names (``NAME:POLICY``, NAME in
    :data:`PEER_ROUTERS`), else None."""
    name, colon, _ = kind.partition(":")
    return name if colon and name in PEER_ROUTERS else None


def gateway_for(kind: str, worker_urls: Sequence[str], logs: Path,
                **router_kw: Any) -> Gateway | None:
    """The gateway an :class:`~benchmarks.serving.fleet.Arm` names (None: client-side RR):
    ``client-rr``, ``kvcentric`` or ``NAME:POLICY`` of one of :data:`PEER_ROUTERS`."""
    if kind == "client-rr":
        return None
    peer = peer_name(kind)
    if peer is not None:
        return PEER_ROUTERS[peer](kind.partition(":")[2], worker_urls, logs,
                                  router_kw.get("tokenizer"))
    if kind == "kvcentric":
        return kvcentric_router(worker_urls=worker_urls, logs=logs, **router_kw)
    raise ValueError(f"unknown gateway {kind!r}")
