"""``kvcentric`` command line: store service commands and the doctor.

    kvcentric store serve [--name N] [--capacity 4gb] [--idle-timeout S]
                          [--disk-path DIR --disk-capacity 2tb]
    kvcentric store stop  [--name N]
    kvcentric store stats [--name N] [--prometheus]
    kvcentric store exporter [--name N] [--host 127.0.0.1] [--port 9464]
    kvcentric store mooncake-master [--host 127.0.0.1] [--port 50051] ...
    kvcentric store mooncake-node --segment 16gb --master HOST:PORT ...
    kvcentric doctor [--store JSON] [--router-config FILE] [--url ENGINE_URL]
                     [--engine vllm|sglang ...] [--skip-engines] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from kvcentric.config import StoreConfig, parse_size
from kvcentric.extras import run_cli
from kvcentric.store.local.config import socket_path

# a store capacity under this is warned about: it holds at most one block of an 8B model
TINY_CAPACITY = 64 << 20


def _store_cfg(args: argparse.Namespace) -> StoreConfig:
    raw: dict[str, object] = {"name": args.name, "autostart": False}
    if getattr(args, "capacity", None):
        raw["capacity_bytes"] = parse_size(args.capacity)
    if getattr(args, "idle_timeout", None) is not None:
        raw["idle_timeout_s"] = args.idle_timeout
    if args.runtime_dir:
        raw["runtime_dir"] = args.runtime_dir
    disk_path, disk_capacity = getattr(args, "disk_path", None), getattr(args, "disk_capacity",
                                                                          None)
    if disk_path and not disk_capacity:  # name the flags, not the config fields
        raise ValueError("--disk-path needs --disk-capacity, the disk tier's bound (e.g. "
                         "--disk-capacity 500gb)")
    if disk_capacity and not disk_path:
        raise ValueError("--disk-capacity needs --disk-path, the disk tier's directory")
    if disk_path or disk_capacity:  # StoreConfig says what else is wrong
        raw["disk"] = {k: v for k, v in (("path", disk_path), ("capacity", disk_capacity)) if v}
    cfg = StoreConfig.from_dict(raw)
    if args.action == "serve" and cfg.local.capacity_bytes < TINY_CAPACITY:
        print(f"kvcentric store serve: warning: --capacity {args.capacity} is "
              f"{cfg.local.capacity_bytes} bytes; a store holds whole blocks, and one 256-token "
              f"block of an 8B model is 32 MiB: give it a few GiB (sizes take a unit, e.g. "
              f"--capacity 8gb)", file=sys.stderr)
    return cfg


def _serve(cfg: StoreConfig) -> int:
    from kvcentric.store import StoreUnavailable
    from kvcentric.store.local import launcher
    from kvcentric.store.local.ownership import StartRefused
    from kvcentric.store.local.server import Coordinator

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        with launcher.start_lock(cfg):  # refuses a runtime dir not ours to trust
            if launcher.is_running(cfg):
                print(f"store {cfg.name!r} is already running at {socket_path(cfg)}",
                      file=sys.stderr)
                return 1
    except (StoreUnavailable, OSError) as exc:
        print(f"store {cfg.name!r} refused to start: {exc}", file=sys.stderr)
        return 1
    coordinator = Coordinator(cfg)
    try:
        coordinator.prepare()  # e.g. a stopped coordinator still holds the store
    except StartRefused as exc:
        print(f"store {cfg.name!r} refused to start: {exc}", file=sys.stderr)
        return 1
    coordinator.serve()
    return 0


def _stats(cfg: StoreConfig, prometheus: bool) -> int:
    from kvcentric.store import StoreUnavailable, open_store
    from kvcentric.store.metrics import log_line, prometheus_text

    try:
        with open_store(cfg) as store:
            stats = store.stats()
    except StoreUnavailable as exc:
        print(f"store {cfg.name!r} is not running: {exc}", file=sys.stderr)
        return 1
    if prometheus:
        sys.stdout.write(prometheus_text(stats, cfg.name).decode())
    else:
        print(log_line(stats))
        print(json.dumps(stats, indent=2))
    return 0


def _store_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    store = sub.add_parser("store", help="run and inspect the local KV store")
    ssub = store.add_subparsers(dest="action", required=True)
    for name in ("serve", "stop", "stats", "exporter"):
        p = ssub.add_parser(name)
        p.add_argument("--name", default="default")
        p.add_argument("--runtime-dir", default=None)
        if name == "serve":
            p.add_argument("--capacity", default="4gb", help="hard bound, e.g. 4gb")
            p.add_argument("--idle-timeout", type=float, default=0.0,
                           help="exit after this many seconds without clients (0: never)")
            p.add_argument("--disk-path", default=None,
                           help="SSD tier: directory for objects DRAM evicts (with "
                                "--disk-capacity)")
            p.add_argument("--disk-capacity", default=None, help="SSD tier bound, e.g. 2tb")
        if name == "stats":
            p.add_argument("--prometheus", action="store_true")
        if name == "exporter":
            p.add_argument("--host", default="127.0.0.1", help="address to serve /metrics on")
            p.add_argument("--port", type=int, default=9464)
    from kvcentric.store.backends import BACKENDS

    for backend in BACKENDS.values():  # e.g. mooncake-master, mooncake-node
        if backend.add_commands is not None:
            backend.add_commands(ssub)


def _doctor_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    d = sub.add_parser("doctor", help="find misconfigurations and say how to fix them",
                       description="Checks the installed engines, the vLLM plugin, the "
                       "store (reachable, capacity vs /dev/shm, Mooncake master, RDMA), "
                       "the layout the engine at --url writes vs what the store holds (one "
                       "probe completion under a fresh cache_salt; $VLLM_API_KEY or "
                       "$KVCENTRIC_ROUTER_UPSTREAM_API_KEY is sent if set) and the router "
                       "config vs its engines. Exit 1 on a problem.")
    d.add_argument("--store", default=None,
                   help="the store config as JSON (like the connector's 'store'), or @FILE; "
                        "default: the router config's store")
    d.add_argument("--router-config", default=None, help="router YAML to check")
    d.add_argument("--url", default=None, help="an engine's http://host:port")
    d.add_argument("--engine", action="append", choices=["vllm", "sglang"], default=None,
                   help="inspect only this installed engine (repeat for both; default: "
                        "both); the vLLM plugin is checked with vllm")
    d.add_argument("--skip-engines", action="store_true",
                   help="leave out the installed-engine and plugin checks (each imports "
                        "vLLM or SGLang), e.g. on a host that runs no engine")
    d.add_argument("--json", action="store_true", help="print the findings as JSON")
    d.set_defaults(run=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvcentric.doctor import FAIL, DoctorInputs, render, run
    from kvcentric.doctor.diagnose import ENGINES

    store = None
    if args.store:
        try:
            text = (Path(args.store[1:]).read_text() if args.store.startswith("@")
                    else args.store)
            store = StoreConfig.from_dict(json.loads(text))
        except OSError as exc:  # @FILE that is missing or unreadable
            print(f"kvcentric doctor: --store {args.store}: cannot read "
                  f"{exc.filename or args.store[1:]}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        except (json.JSONDecodeError, ValueError, TypeError) as exc:
            print(f"kvcentric doctor: --store: {exc}", file=sys.stderr)
            return 2
    if args.skip_engines and args.engine:
        print("kvcentric doctor: --engine and --skip-engines exclude each other",
              file=sys.stderr)
        return 2
    engines = () if args.skip_engines else tuple(args.engine or ENGINES)
    findings = run(DoctorInputs(store, args.router_config, args.url, engines=engines))
    if args.json:
        print(json.dumps({"ok": not any(f.status == FAIL for f in findings),
                          "findings": [f.as_dict() for f in findings]}, indent=2))
    else:
        print(render(findings))
    return 1 if any(f.status == FAIL for f in findings) else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvcentric")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _store_parser(sub)
    _doctor_parser(sub)
    # dispatched before parsing (:func:`_main`): every argument after it is bench_serving's
    sub.add_parser("bench", add_help=False,
                   help="load an OpenAI-compatible endpoint: multi-turn, shared-prefix, "
                        "trace replay (kvcentric bench --help)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """The ``kvcentric`` command; a missing optional dependency is one line and exit 2."""
    return run_cli("kvcentric", _main, argv)


def _main(argv: list[str] | None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["bench"]:
        from kvcentric.bench_serving.loadgen import main as bench

        return bench((sys.argv[1:] if argv is None else argv)[1:], prog="kvcentric bench")
    args = build_parser().parse_args(argv)
    if hasattr(args, "run"):  # doctor and the mooncake service commands
        return int(args.run(args))
    try:
        cfg = _store_cfg(args)
    except ValueError as exc:  # a bad flag is the operator's to fix: say what, no traceback
        print(f"kvcentric store {args.action}: {exc}", file=sys.stderr)
        return 2
    if args.action == "serve":
        return _serve(cfg)
    if args.action == "exporter":
        from kvcentric.store.exporter import serve

        return serve(cfg, args.host, args.port)
    if args.action == "stop":
        from kvcentric.store import StoreUnavailable
        from kvcentric.store.local import launcher

        try:  # with the admin token next to the socket
            stopped = launcher.stop(cfg)
        except StoreUnavailable as exc:
            print(f"kvcentric store stop: {exc}", file=sys.stderr)
            return 1
        print(f"store {cfg.name!r} {'stopped' if stopped else 'was not running'}")
        return 0
    return _stats(cfg, args.prometheus)


if __name__ == "__main__":
    sys.exit(main())
