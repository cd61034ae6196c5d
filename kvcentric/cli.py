"""``kvcentric`` command line: store service commands.

    kvcentric store serve [--name N] [--capacity 4gb] [--idle-timeout S]
    kvcentric store stop  [--name N]
    kvcentric store stats [--name N] [--prometheus]
    kvcentric store mooncake-master [--host 127.0.0.1] [--port 50051] ...
    kvcentric store mooncake-node --segment 16gb --master HOST:PORT ...
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from kvcentric.config import StoreConfig, parse_size


def _store_cfg(args: argparse.Namespace) -> StoreConfig:
    raw: dict[str, object] = {"name": args.name, "autostart": False}
    if getattr(args, "capacity", None):
        raw["capacity_bytes"] = parse_size(args.capacity)
    if getattr(args, "idle_timeout", None) is not None:
        raw["idle_timeout_s"] = args.idle_timeout
    if args.runtime_dir:
        raw["runtime_dir"] = args.runtime_dir
    return StoreConfig.from_dict(raw)


def _serve(cfg: StoreConfig) -> int:
    from kvcentric.store.local import launcher
    from kvcentric.store.local.server import Coordinator

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    with launcher.start_lock(cfg):
        if launcher.is_running(cfg):
            print(f"store {cfg.name!r} is already running at {cfg.socket_path}", file=sys.stderr)
            return 1
    Coordinator(cfg).serve()
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
    for name in ("serve", "stop", "stats"):
        p = ssub.add_parser(name)
        p.add_argument("--name", default="default")
        p.add_argument("--runtime-dir", default=None)
        if name == "serve":
            p.add_argument("--capacity", default="4gb", help="hard bound, e.g. 4gb")
            p.add_argument("--idle-timeout", type=float, default=0.0,
                           help="exit after this many seconds without clients (0: never)")
        if name == "stats":
            p.add_argument("--prometheus", action="store_true")
    from kvcentric.store.mooncake.service import add_mooncake_commands

    add_mooncake_commands(ssub)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvcentric")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _store_parser(sub)
    args = ap.parse_args(argv)
    if hasattr(args, "run"):  # the mooncake service commands
        return int(args.run(args))
    cfg = _store_cfg(args)
    if args.action == "serve":
        return _serve(cfg)
    if args.action == "stop":
        from kvcentric.store.local import launcher

        stopped = launcher.stop(cfg)
        print(f"store {cfg.name!r} {'stopped' if stopped else 'was not running'}")
        return 0
    return _stats(cfg, args.prometheus)


if __name__ == "__main__":
    sys.exit(main())
