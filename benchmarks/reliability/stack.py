"""The system a fault is injected into: a store, two vLLM CPU engines with the connector,
the kvcentric router; and the faults themselves (real SIGKILLs, by PID; and SIGSTOP /
SIGCONT of a store process, :meth:`Stack.pause` / :meth:`Stack.resume`, for the ``-stop``
faults of :mod:`benchmarks.reliability.stops`).

``local``: the embedded store (its coordinator is started by the first engine).
``mooncake``: ``mooncake_master`` + one storage node, everything inside a private network
namespace (Mooncake binds all interfaces); the caller's thread must be inside it
(``stack.ns.entered()``) for HTTP to reach the servers.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from benchmarks.micro.store_mooncake import MASTER, start_cluster, start_node
from kvcentric.config import StoreConfig
from kvcentric.store import open_store
from kvcentric.store.local import launcher
from kvcentric.testing.netns import NetNamespace
from kvcentric.testing.servers import (
    VllmServer,
    connector_config,
    free_port,
    spawn,
    stop_group,
    wait_http,
)
from kvcentric.testing.signals import sigstop_group

FAULTS = {"local": ("coordinator", "engine", "router", "coordinator-stop"),
          "mooncake": ("master", "node", "engine", "master-stop", "node-stop")}

WRITER_HOT_TIMEOUT_S = 1.0


class Stack:
    """Store + engines ``e0``, ``e1`` + router, started by :meth:`start`."""

    def __init__(self, backend: str, model: str, logs: Path, ns: NetNamespace | None,
                 capacity: str = "512mb", connector: bool = True,
                 engine_env: dict[str, str] | None = None) -> None:
        """``capacity``: the local store's (small: eviction runs all the time);
        ``connector=False``: engines without kvcentric (a baseline: vLLM alone);
        ``engine_env``: added to each engine's environment (e.g. a preloaded allocator)."""
        if backend not in FAULTS:
            raise ValueError(f"unknown backend {backend!r}")
        if backend == "mooncake" and ns is None:
            raise ValueError("the mooncake stack needs a network namespace")
        self.backend, self.model, self.logs, self.ns = backend, model, logs, ns
        self.router_port = free_port()
        self.url = f"http://127.0.0.1:{self.router_port}"
        self.router: subprocess.Popen[bytes] | None = None
        self.cluster: list[subprocess.Popen[Any]] = []
        self._paused: set[int] = set()  # process groups we SIGSTOPped (resumed at stop())
        if backend == "local":
            rt = tempfile.mkdtemp(prefix="kvc-faults-", dir="/dev/shm")
            self.store: dict[str, Any] = {"name": f"f{uuid.uuid4().hex[:6]}",
                                          "capacity": capacity, "runtime_dir": rt}
        else:
            self.store = {"backend": "mooncake", "mooncake": {
                "master_server_address": MASTER, "metadata_server": "P2PHANDSHAKE",
                "use_env": False, "global_segment_size": 0, "staging_size": "256mb"}}
        # the writer e0 bounds its store calls at WRITER_HOT_TIMEOUT_S, not the default:
        # a round's precondition is its prompts stored, and on a loaded 2-core box the
        # writer's own prefill can starve a put past the default bound (its breaker then
        # skips the batch's saves); the reader e1, whose bounded calls the rows measure,
        # keeps the default
        stores = [{**self.store, "hot_timeout_s": WRITER_HOT_TIMEOUT_S}, self.store]
        self.engines = [VllmServer(model, log_path=logs / f"faults-{backend}-e{i}.log",
                                   kv_transfer=connector_config(stores[i]) if connector
                                   else None,
                                   args=("--enable-prompt-tokens-details",),
                                   env=engine_env or {})
                        for i in range(2)]

    # ---- lifecycle ----
    def start(self) -> Stack:
        if self.backend == "mooncake":
            assert self.ns is not None
            self.cluster = start_cluster(self.ns, self.logs, f"faults-{self.backend}")
            self.cluster.append(start_node(self.ns, "1gb", self.logs, "faults-node"))
        for e in self.engines:
            e.start()
        for e in self.engines:
            e.wait_ready(600)
        self.start_router()
        return self

    def start_router(self) -> None:
        cfg = {"model": "tiny", "tokenizer": self.model, "listen": {"port": self.router_port},
               "store": self.store, "upstream": {"timeout_s": 120, "retries": 2},
               "health": {"interval_s": 0.5, "timeout_s": 2, "unhealthy_after": 2},
               "instances": [{"url": e.url, "role": "both", "name": f"e{i}"}
                             for i, e in enumerate(self.engines)]}
        path = self.logs / f"faults-{self.backend}-router.yaml"
        path.write_text(yaml.safe_dump(cfg))
        log = self.logs / f"faults-{self.backend}-router.log"
        self.router = spawn([sys.executable, "-m", "kvcentric.router.cli", "serve",
                             "--config", str(path)], log)
        wait_http(self.url + "/health", self.router, log, 60)

    def stop(self) -> None:
        for pgid in list(self._paused):
            self._signal(pgid, signal.SIGCONT)
        stop_group(self.router)
        for e in self.engines:
            e.stop()
        for p in reversed(self.cluster):
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)
        if self.backend == "local":
            launcher.stop(StoreConfig.from_dict(self.store))
            shutil.rmtree(self.store["runtime_dir"], ignore_errors=True)  # our mkdtemp

    # ---- faults: each is a SIGKILL of a process this stack started ----
    def inject(self, fault: str) -> None:
        """Kill ``fault``'s process; a supervisor's restart follows for the router, the
        Mooncake master and node (the local coordinator is restarted by its clients)."""
        if fault == "engine":
            proc = self.engines[1].proc
            assert proc is not None
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
        elif fault == "coordinator":
            with open_store(self.store) as s:
                pid = int(s.stats()["pid"])
            os.kill(pid, signal.SIGKILL)
        elif fault == "router":
            assert self.router is not None
            os.killpg(os.getpgid(self.router.pid), signal.SIGKILL)
            self.router.wait()
            self.start_router()
        elif fault in ("master", "node"):
            self._restart_mooncake(fault)
        else:
            raise ValueError(f"unknown fault {fault!r}")

    # ---- SIGSTOP / SIGCONT of a store process ----
    def victim(self, which: str) -> int:
        """The process group of ``which``: ``coordinator`` (the local store's, started in a
        session of its own), ``master`` or ``node`` (Mooncake's, each its own group)."""
        if which == "coordinator":
            with open_store(dict(self.store, prefault=False)) as s:
                return int(s.stats()["pid"])
        if which in ("master", "node"):
            return os.getpgid(self.cluster[0 if which == "master" else 1].pid)
        raise ValueError(f"no store process {which!r}")

    def pause(self, pgid: int) -> None:
        """SIGSTOP the process group ``pgid`` (from :meth:`victim`)."""
        self._paused.add(pgid)
        try:
            sigstop_group(pgid)  # returns once it has stopped, not when the signal is queued
        except ProcessLookupError:
            pass

    def resume(self, pgid: int) -> None:
        self._signal(pgid, signal.SIGCONT)
        self._paused.discard(pgid)

    @staticmethod
    def _signal(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass

    def _restart_mooncake(self, which: str) -> None:
        assert self.ns is not None
        i = 0 if which == "master" else 1
        victim = self.cluster[i]
        os.killpg(os.getpgid(victim.pid), signal.SIGKILL)
        victim.wait()
        time.sleep(2.0)  # the supervisor's restart delay
        if which == "master":
            self.cluster[0] = start_cluster(self.ns, self.logs, "faults-master2")[0]
        else:
            self.cluster[1] = start_node(self.ns, "1gb", self.logs, "faults-node2")
