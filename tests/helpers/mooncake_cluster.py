"""A real Mooncake Store cluster for tests: ``mooncake_master`` plus storage nodes, all in a
private network namespace (loopback only), because Mooncake listens on every interface.

Ports are fixed: the namespace has its own port space, so parallel test sessions never
collide. Processes run in their own process groups and are ended by pid at :meth:`stop`.

One process must keep all its Mooncake clients in one namespace: Mooncake's I/O threads
are process-wide and stay in the namespace of the first client. A second cluster in the
same test process therefore shares the first one's namespace (``ns=``; the session's is
the ``mooncake_ns`` fixture), on other ports while both run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvcentric.store.mooncake.service import master_command, wait_master
from kvcentric.testing.netns import NetNamespace
from tests.helpers.e2e_store import TEST_HOT_TIMEOUT_S

HOST, RPC_PORT, METRICS_PORT, METADATA_PORT = "127.0.0.1", 50051, 9003, 8080
ROOT = Path(__file__).resolve().parents[2]
# the master's client TTL in tests (see MooncakeCluster): Mooncake's default. 5 s saved
# 12 s of node-kill tests, but in a parallel make test a loaded box once delayed a client
# past it (a put failed TRANSFER_FAIL where the test expects the full store's refusal)
CLIENT_TTL_S = 10


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without ambient Mooncake settings (a test says what it uses)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MOONCAKE_", "MC_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env | extra


def end(proc: subprocess.Popen[Any] | None, sig: int = signal.SIGTERM,
        timeout: float = 15.0) -> None:
    """Stop a process group we started: ``sig``, then SIGKILL after ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class MooncakeCluster:
    """A master (``lease_ttl_ms`` read leases; a node or client silent for ``client_ttl_s``
    is dropped with its segment) and named storage nodes in one namespace.

    ``client_ttl_s`` (Mooncake's default, 10 s): tests that kill a node wait for the master
    to drop it, and that wait is this TTL. It stays well above a heartbeat's
    delay on a loaded box, above the longest SIGSTOP a test holds a node or the master for
    (a live node would be dropped), and above the one request a test sends right after a
    kill to see the dead node's objects still listed (a load error, not a miss)."""

    def __init__(self, logdir: Path, lease_ttl_ms: int = 500, http_metadata: bool = False,
                 ns: NetNamespace | None = None, port_offset: int = 0,
                 client_ttl_s: int = CLIENT_TTL_S) -> None:
        self.logdir = logdir
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.http_metadata = http_metadata
        self.own_ns = ns is None
        self.ns = ns or NetNamespace().start()
        self.rpc_port = RPC_PORT + port_offset
        self.metrics_port = METRICS_PORT + port_offset
        self.metadata_port = METADATA_PORT + port_offset
        self.master: subprocess.Popen[bytes] | None = None
        self.nodes: dict[str, subprocess.Popen[str]] = {}

    @property
    def metadata_server(self) -> str:
        if self.http_metadata:
            return f"http://{HOST}:{self.metadata_port}/metadata"
        return "P2PHANDSHAKE"

    def entered(self) -> Any:
        return self.ns.entered()

    def start_master(self) -> None:
        cmd = master_command(HOST, self.rpc_port, self.metrics_port,
                             self.metadata_port if self.http_metadata else 0, self.lease_ttl_ms,
                             extra=[f"--client_ttl={self.client_ttl_s}"])
        log = open(self.logdir / "master.log", "ab")
        self.master = subprocess.Popen(self.ns.wrap(cmd), stdout=log, stderr=log,
                                       start_new_session=True)
        log.close()
        with self.entered():
            wait_master(HOST, self.rpc_port, self.metrics_port, proc=self.master)

    def kill_master(self) -> None:
        end(self.master, signal.SIGKILL)

    def mooncake(self, **over: Any) -> dict[str, Any]:
        """The backend's ``mooncake`` settings for a client of this cluster."""
        return {"master_server_address": f"{HOST}:{self.rpc_port}",
                "metrics_url": f"http://{HOST}:{self.metrics_port}/metrics",
                "metadata_server": self.metadata_server, "use_env": False,
                "probe_interval_s": 0.2, "staging_size": "64mb", **over}

    def store_config(self, **over: Any) -> dict[str, Any]:
        """An ``open_store`` dict; a pure client (segment 0) unless ``over`` says otherwise.

        Its hot bound is 1 s, not the default 0.1 s: on a shared 2-core box a call now and
        then waits over 100 ms for a core, which opens the breaker (a recompute), and tests
        that check what a call returns are not about that; tests/store/test_store_mooncake_hung.py
        tests the bound itself."""
        return {"backend": "mooncake", "op_timeout_s": 5.0,
                "hot_timeout_s": TEST_HOT_TIMEOUT_S,
                "mooncake": self.mooncake(**over)}

    def start_node(self, name: str, segment: str = "64mb") -> subprocess.Popen[str]:
        """A storage-only node via ``kvcentric store mooncake-node``; returns once mounted."""
        cmd = [sys.executable, "-m", "kvcentric.store.mooncake.service", "mooncake-node",
               "--segment", segment, "--master", f"{HOST}:{self.rpc_port}",
               "--metadata", self.metadata_server]
        log = open(self.logdir / f"node-{name}.log", "ab")
        proc = subprocess.Popen(self.ns.wrap(cmd), stdout=subprocess.PIPE, stderr=log, text=True,
                                env=clean_env(), start_new_session=True)
        log.close()
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "mooncake node ready" not in line:
            end(proc, signal.SIGKILL)
            raise RuntimeError(f"storage node {name} failed: {line!r}; see {self.logdir}")
        self.nodes[name] = proc
        return proc

    def kill_node(self, name: str, sig: int = signal.SIGKILL) -> None:
        end(self.nodes.pop(name, None), sig)

    def stop(self) -> None:
        for name in list(self.nodes):
            self.kill_node(name, signal.SIGTERM)
        end(self.master)
        if self.own_ns:
            self.ns.stop()


@contextmanager
def cluster(logdir: Path, **kw: Any) -> Iterator[MooncakeCluster]:
    c = MooncakeCluster(logdir, **kw)
    try:
        c.start_master()
        yield c
    finally:
        c.stop()


def module_cluster_fixtures(logdir: str) -> tuple[Any, Any]:
    """A test module's ``mc`` fixture (one cluster for the module, its logs under a
    temporary ``logdir``, in the session's ``mooncake_ns``) and ``_in_netns`` (autouse:
    each test's thread, and what it starts, runs inside that namespace). Use as
    ``mc, _in_netns = module_cluster_fixtures("name")``: pytest finds fixtures by those
    module-level names."""

    @pytest.fixture(scope="module")
    def mc(tmp_path_factory: pytest.TempPathFactory, mooncake_ns: NetNamespace
           ) -> Iterator[MooncakeCluster]:
        with cluster(tmp_path_factory.mktemp(logdir), ns=mooncake_ns) as c:
            yield c

    @pytest.fixture(autouse=True)
    def _in_netns(mc: MooncakeCluster) -> Iterator[None]:
        with mc.entered():
            yield

    return mc, _in_netns
