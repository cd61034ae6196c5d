"""Mooncake services: ``kvcentric store mooncake-master`` and ``kvcentric store mooncake-node``.

    kvcentric store mooncake-master [--host 127.0.0.1] [--port 50051] [--metrics-port 9003]
                                    [--metadata-port 8080 | --metadata-port 0]
                                    [--lease-ttl-ms 10000] [--log FILE] [-- MASTER_FLAGS...]
    kvcentric store mooncake-node --segment 4gb [--config FILE.json] [--master H:P] ...

``mooncake-master`` runs the wheel's ``mooncake_master`` in the foreground with loopback
defaults: RPC on ``--host:--port``, Prometheus metrics on ``--metrics-port`` and its HTTP
metadata server (``http://HOST:8080/metadata``; ``--metadata-port 0`` leaves it off, for
clients using ``P2PHANDSHAKE``). ``mooncake-node`` is a storage-only node like Mooncake's
``mooncake_store_service``: a client that contributes ``--segment`` bytes to the pool and
serves them until SIGTERM/SIGINT; engines then run as pure clients (segment 0).

Both accept the backend's config sources (``--config`` JSON, KEP-74 ``MOONCAKE_*`` env).
Mooncake listens on all interfaces whatever address it is given: on one machine run it in
a private network namespace (``unshare -n``; ``examples/multi-node-mooncake/``), across
machines behind the cluster's network policy.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcentric.extras import MissingExtra, install_hint
from kvcentric.store.mooncake.health import tcp_accepts

log = logging.getLogger("kvcentric.store")


def master_binary() -> Path:
    """Path of the ``mooncake_master`` executable shipped in the Mooncake wheel."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtra(f"the Mooncake wheel is not installed: {install_hint('mooncake')}")
    path = Path(next(iter(spec.submodule_search_locations))) / "mooncake_master"
    if not path.is_file():
        raise FileNotFoundError(f"no mooncake_master in the Mooncake wheel ({path})")
    return path


# Offload at PutEnd (not --offload_on_evict, which defers the disk write to eviction time
# and refused puts while the deferred writes waited, as the CPU wheel does).
OFFLOAD_FLAGS = ("--enable_offload=true", "--promotion_on_hit=true")


def master_command(host: str = "127.0.0.1", port: int = 50051, metrics_port: int = 9003,
                   metadata_port: int = 8080, lease_ttl_ms: int | None = None,
                   extra: Sequence[str] = (), offload: bool = False) -> list[str]:
    """The ``mooncake_master`` command line for these settings (logs go to stderr).
    ``offload``: Mooncake's SSD tier (:data:`OFFLOAD_FLAGS`): the master queues completed
    objects for the owning node's ``ssd_offload_path`` (written by the node's offload
    heartbeat, in buckets) and promotes them back to memory on a hit."""
    cmd = [str(master_binary()), f"--rpc_address={host}", f"--rpc_port={port}",
           f"--metrics_host={host}", f"--metrics_port={metrics_port}", "--logtostderr=true"]
    if metadata_port:
        cmd += ["--enable_http_metadata_server=true", f"--http_metadata_server_host={host}",
                f"--http_metadata_server_port={metadata_port}"]
    if lease_ttl_ms is not None:
        cmd.append(f"--default_kv_lease_ttl={lease_ttl_ms}")
    if offload:
        cmd += OFFLOAD_FLAGS
    return cmd + list(extra)


def wait_master(host: str, port: int, metrics_port: int, timeout_s: float = 30.0,
                proc: subprocess.Popen[Any] | None = None) -> None:
    """Block until the master accepts RPC and metrics connections; raise if it exits or
    ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}")
        if tcp_accepts(host, port, 0.5) and tcp_accepts(host, metrics_port, 0.5):
            return
        time.sleep(0.1)
    raise TimeoutError(f"mooncake_master not serving on {host}:{port} after {timeout_s} s")


def _stop_event() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def run_master(args: argparse.Namespace) -> int:
    """Foreground ``mooncake_master``; forwards SIGTERM/SIGINT and returns its exit code."""
    cmd = master_command(args.host, args.port, args.metrics_port, args.metadata_port,
                         args.lease_ttl_ms, args.master_flags, args.offload)
    out = open(args.log, "ab") if args.log else None
    proc = subprocess.Popen(cmd, stdout=out, stderr=out)
    stop = _stop_event()
    try:
        wait_master(args.host, args.port, args.metrics_port, proc=proc)
        meta = (f"http://{args.host}:{args.metadata_port}/metadata" if args.metadata_port
                else "P2PHANDSHAKE")
        print(f"mooncake master ready: master_server_address {args.host}:{args.port}, "
              f"metadata_server {meta}, metrics http://{args.host}:{args.metrics_port}/metrics",
              flush=True)
        while proc.poll() is None and not stop.wait(0.2):
            pass
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        if out is not None:
            out.close()
    return 0 if stop.is_set() else int(proc.returncode or 0)


def node_config(args: argparse.Namespace) -> dict[str, Any]:
    """The ``mooncake`` mapping of a storage-only node from the command line."""
    raw: dict[str, Any] = {}
    if args.segment is not None:
        raw["global_segment_size"] = args.segment
    if args.config:
        raw["config_path"] = args.config
    for flag, key in (("master", "master_server_address"), ("metadata", "metadata_server"),
                      ("protocol", "protocol"), ("device", "device_name"),
                      ("hostname", "local_hostname"), ("ssd_offload_path", "ssd_offload_path")):
        if getattr(args, flag) is not None:
            raw[key] = getattr(args, flag)
    raw["staging_size"] = "1mb"  # a node never reads or writes in place
    return raw


def run_node(args: argparse.Namespace) -> int:
    """Contribute a segment to the pool until SIGTERM/SIGINT."""
    from kvcentric.config import StoreConfig
    from kvcentric.store.mooncake.config import engine_env, offload_env
    from kvcentric.store.mooncake.store import MooncakeStore

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = _stop_event()
    cfg = StoreConfig(backend="mooncake", sections={"mooncake": node_config(args)})
    settings = cfg.mooncake
    os.environ.update(engine_env(settings))  # a command's own process: set before the engine
    os.environ.update(offload_env(settings))
    if not settings.global_segment_size:
        print("a storage node needs a segment: --segment 4gb (or global_segment_size in "
              "--config, or MOONCAKE_GLOBAL_SEGMENT_SIZE)", file=sys.stderr)
        return 2
    store = MooncakeStore(cfg)
    s = store.settings
    while not store.health_check():  # joins in the background when started before its master
        if stop.wait(0.5):
            store.close()
            return 0
    print(f"mooncake node ready: {s.global_segment_size} B segment on {s.local_hostname}, "
          f"master {s.master_server_address}", flush=True)
    try:
        stop.wait()
    finally:
        store.close()
    return 0


def add_mooncake_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``mooncake-master`` and ``mooncake-node`` to the ``kvcentric store`` subparsers;
    each sets ``args.run`` (call it with ``args``; it returns the exit code)."""
    m = sub.add_parser("mooncake-master", help="run mooncake_master (loopback defaults)")
    m.add_argument("--host", default="127.0.0.1", help="RPC, metrics and metadata address")
    m.add_argument("--port", type=int, default=50051, help="RPC port")
    m.add_argument("--metrics-port", type=int, default=9003)
    m.add_argument("--metadata-port", type=int, default=8080,
                   help="HTTP metadata server port (0: none; clients use P2PHANDSHAKE)")
    m.add_argument("--lease-ttl-ms", type=int, default=None,
                   help="read lease of objects (Mooncake's default: 10000)")
    m.add_argument("--log", default=None, help="append the master's log here")
    m.add_argument("--offload", action="store_true",
                   help="Mooncake's SSD offload: nodes started with --ssd-offload-path "
                        "write objects to disk and serve them after memory evicts them")
    m.add_argument("master_flags", nargs="*", help="after --: more mooncake_master flags")
    m.set_defaults(run=run_master)
    n = sub.add_parser("mooncake-node", help="contribute memory to a Mooncake Store")
    n.add_argument("--segment", default=None, help="bytes to contribute, e.g. 16gb")
    n.add_argument("--config", default=None, help="Mooncake JSON config file")
    n.add_argument("--master", default=None, help="master host:port")
    n.add_argument("--metadata", default=None, help="P2PHANDSHAKE or http://.../metadata")
    n.add_argument("--protocol", default=None, choices=["tcp", "rdma"])
    n.add_argument("--device", default=None, help="RDMA devices (empty: discover)")
    n.add_argument("--hostname", default=None, help="address other nodes reach this one at")
    n.add_argument("--ssd-offload-path", default=None,
                   help="directory for Mooncake's SSD tier (master started with --offload)")
    n.set_defaults(run=run_node)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvcentric.store.mooncake.service mooncake-master|mooncake-node ...``"""
    from kvcentric.extras import run_cli

    return run_cli("kvcentric store", _main, argv)


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(prog="kvcentric store")
    add_mooncake_commands(ap.add_subparsers(dest="action", required=True))
    args = ap.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
