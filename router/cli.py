"""``kvcentric-router`` command line.

    kvcentric-router init [PATH] [--model NAME] [--tokenizer DIR] [--instance URL ...]
    kvcentric-router serve --config router.yaml [--host H] [--port P]
    kvcentric-router profile --url http://127.0.0.1:8100 --model tiny --out profile.json
        [--lengths 256,512,1024,2048] [--hits 0,0.5,0.9] [--repeats 2]
        [--model-dir DIR --store-tokens 2048]   # also measure the store tier's bandwidth
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {exc}") from exc
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError("expected positive integers")
    return vals


def _fracs(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers: {exc}") from exc
    if not vals or any(not 0 <= v < 1 for v in vals):
        raise argparse.ArgumentTypeError("hit fractions must be in [0, 1)")
    return vals


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvcentric.router.api.app import build_app
    from kvcentric.router.config import load_config

    cfg = load_config(args.config)
    listen = cfg.listen
    if args.host or args.port is not None:
        listen = replace(listen, host=args.host or listen.host,
                         port=args.port if args.port is not None else listen.port)
        cfg = replace(cfg, listen=listen)
    level = (args.log_level or cfg.log_level).lower()
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(message)s")
    app = build_app(cfg)
    # What startup made (modules, the tokenizer's Python side, config) lives as long as
    # the process: out of the collector's generations, no full collection visits it again
    gc.freeze()
    uvicorn.run(app, host=listen.host, port=listen.port, log_level=level,
                access_log=level == "debug")
    return 0


def _profile(args: argparse.Namespace) -> int:
    from kvcentric.router.cost.cost_model import kv_bytes_per_token
    from kvcentric.router.cost.profile import run_profile

    kvb = kv_bytes_per_token(args.model_dir, args.kv_dtype) if args.model_dir else None
    if args.disk_path is not None and not args.disk_path.is_dir():
        raise ValueError(f"--disk-path {args.disk_path} is not a directory")
    prof = run_profile(args.url, args.model, lengths=args.lengths, hits=args.hits,
                       repeats=args.repeats, page=args.page, kv_bytes_per_token=kvb,
                       block_size=args.block_size or args.page, store_n=args.store_tokens,
                       disk_path=args.disk_path, disk_probe_bytes=args.disk_probe_mib << 20)
    prof.save(args.out)
    print(f"T_prefill(n, h) = {prof.a:.3e}·(n²−h²) + {prof.b:.3e}·(n−h) + {prof.c:.4f} s "
          f"(R² {prof.r2:.3f}, {len(prof.points)} points); TBT {prof.tbt_base_s * 1e3:.1f} ms "
          f"+ {prof.tbt_per_seq_s * 1e3:.2f} ms/seq; store {_gbps(prof.store_bandwidth_bps)}, "
          f"disk {_gbps(prof.disk_bandwidth_bps)} -> {args.out}")
    return 0


# `kvcentric-router init`: the smallest router config, shipped inside the package
# (configs/router.yaml, every setting commented, lives in the repository only).
DEFAULT_INSTANCE = "http://127.0.0.1:8100"

_TEMPLATE = """\
# kvcentric router (the Conductor), written by `kvcentric-router init`.
#   check it:  kvcentric doctor --router-config {path}
#   run it:    kvcentric-router serve --config {path}
# Relative paths are relative to the directory the router is started from.

# The model name the engines serve (vLLM's --served-model-name, else its --model);
# requests naming another model get 404.
model: {model}

# A local model folder (Hugging Face layout), not a hub id: the router reads the tokenizer
# (tokenizer.json or tokenizer_config.json, and the chat template) and config.json (to size
# the KV cache). Any folder holding the served model's tokenizer and config.json will do,
# e.g. the one the engine loads.
tokenizer: {tokenizer}

# Where the router listens. Without API keys (auth.api_keys) it refuses a non-loopback host.
listen: {{host: {host}, port: {port}}}

# The engines. role: both (vLLM kv_role kv_both, or no connector), prefill (kv_producer)
# or decode (kv_consumer). Add kv_events: tcp://127.0.0.1:PORT and start the engine with
#   --kv-events-config '{{"enable_kv_cache_events":true,"publisher":"zmq",
#                        "endpoint":"tcp://127.0.0.1:PORT","topic":"kv"}}'
# for exact per-engine residency (without it the router keeps its own LRU bookkeeping).
instances:
{instances}

# The store the engines' connectors use (the same as their "store" extra config); the
# router only asks it which blocks exist. Uncomment when the engines run kvcentric's
# connector:
# store: {{backend: local, name: default}}

# Every other section (slo, cost, keys, limits, auth, health, upstream, replication, ...)
# has defaults; the README's "The router (Conductor)" section describes each.
"""


def _q(value: str) -> str:
    return json.dumps(value)  # a JSON string is a YAML string, whatever it holds


def render_init(path: str, model: str, tokenizer: str,
                instances: Sequence[str] = (DEFAULT_INSTANCE,), host: str = "127.0.0.1",
                port: int = 8000) -> str:
    """The commented minimal config naming ``model``, the ``tokenizer`` folder and the
    engines at ``instances`` (role ``both``); ``path`` appears in its usage lines.

    Contract: the result is YAML that :func:`kvcentric.router.config.load_config` accepts
    for any name, folder path and ``http://`` URLs (strings are written JSON-quoted, which
    YAML reads back unchanged); the folder and the engines are not checked here
    (``kvcentric doctor --router-config`` does)."""
    lines = "\n".join(f"  - {{url: {_q(url)}, role: both}}" for url in instances)
    return _TEMPLATE.format(path=path, model=_q(model), tokenizer=_q(tokenizer),
                            host=_q(host), port=int(port), instances=lines or "  []")


def _init(args: argparse.Namespace) -> int:
    out = Path(args.path)
    if out.exists() and not args.force:
        print(f"kvcentric-router init: {out} exists (--force replaces it)", file=sys.stderr)
        return 2
    out.write_text(render_init(str(out), args.model, args.tokenizer,
                          args.instance or [DEFAULT_INSTANCE], port=args.port or 8000))
    print(f"wrote {out}: set tokenizer to a local model folder and instances to your "
          f"engines, then: kvcentric doctor --router-config {out}; "
          f"kvcentric-router serve --config {out}")
    return 0


def _gbps(bps: float | None) -> str:
    return f"{bps / 1e9:.2f} GB/s" if bps else "not measured"


def main(argv: list[str] | None = None) -> int:
    """The ``kvcentric-router`` command; a missing optional dependency (the ``router``
    extra) is one line and exit 2."""
    from kvcentric.extras import run_cli

    return run_cli("kvcentric-router", _main, argv)


def build_parser() -> argparse.ArgumentParser:
    """The ``kvcentric-router`` parser (its subcommands: ``init``, ``serve``, ``profile``)."""
    ap = argparse.ArgumentParser(prog="kvcentric-router")
    sub = ap.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init", help="write a minimal, commented router config",
                       description="Write the smallest router config (model, tokenizer "
                       "folder, listen address, engines), each setting explained; every "
                       "other setting keeps its default.")
    i.add_argument("path", nargs="?", default="router.yaml", help="where (router.yaml)")
    i.add_argument("--model", default="my-model", help="the model name the engines serve")
    i.add_argument("--tokenizer", default="/path/to/model-folder",
                   help="a local model folder (tokenizer files and config.json)")
    i.add_argument("--instance", action="append", default=None, metavar="URL",
                   help="an engine's http://host:port (repeat for more; default "
                        "http://127.0.0.1:8100)")
    i.add_argument("--port", type=int, default=None, help="the router's port (8000)")
    i.add_argument("--force", action="store_true", help="replace an existing file")
    s = sub.add_parser("serve", help="run the router")
    s.add_argument("--config", required=True,
                   help="router YAML (write a minimal one with `kvcentric-router init`)")
    s.add_argument("--host", default=None)
    s.add_argument("--port", type=int, default=None)
    s.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])
    p = sub.add_parser("profile", help="time prefills on a running instance, fit the profile")
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--out", required=True)
    p.add_argument("--lengths", type=_ints, default=[256, 512, 1024, 2048])
    p.add_argument("--hits", type=_fracs, default=[0.0, 0.5, 0.9])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--page", type=int, default=128, help="engine page size (tokens)")
    p.add_argument("--block-size", type=int, default=None,
                   help="stored block size (tokens; default: the page size)")
    p.add_argument("--model-dir", default=None, help="model folder (KV bytes per token)")
    p.add_argument("--kv-dtype", default=None)
    p.add_argument("--store-tokens", type=int, default=0,
                   help="prompt length for the store bandwidth probe (0: skip)")
    p.add_argument("--disk-path", type=Path, default=None,
                   help="the local store's disk-tier directory: measure its cold-read "
                        "bandwidth (the cost of disk-only blocks)")
    p.add_argument("--disk-probe-mib", type=int, default=256,
                   help="size of the disk probe's scratch file (MiB)")
    return ap


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "init":
        return _init(args)
    import httpx

    try:
        return _serve(args) if args.cmd == "serve" else _profile(args)
    except (ValueError, OSError, httpx.HTTPError) as exc:
        print(f"kvcentric-router: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
