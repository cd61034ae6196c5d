"""How does an OpenAI-compatible endpoint serve multi-turn, shared-prefix or trace load?

Serving benchmark for any OpenAI-compatible endpoint: multi-turn, shared-prefix,
hit-ratio and Mooncake-trace workloads, with ``vllm bench serve``'s metrics.

    python -m kvcentric.bench_serving --base-url http://127.0.0.1:8000 \\
        --model NAME --tokenizer MODEL_DIR --workload multi-turn --num-users 8 \\
        --turns-mean 4 --turn-gap 1 --slo-ttft-ms 1000 --out result.json

(also ``kvcentric bench ...``; running needs ``pip install 'kvcentric[router]'`` for
httpx and transformers, ``--help`` does not). Trace replay takes Mooncake's format
(``--workload trace --trace FILE.jsonl``: ``timestamp``, ``input_length``,
``output_length``, ``hash_ids``).

Several ``--base-url`` values are served round-robin per request (``--routing session``
keeps a user on one URL). Prompts are token-exact: built from the model's own tokenizer
(``--tokenizer``), sent as text that round-trips (or as token ids, ``--prompt-format ids``)
and, for ``--endpoint chat``, counted with the model's chat template. A tokenizer without
such text (e.g. a word-level one) gets token-id prompts on ``/v1/completions``
(``--prompt-format auto``, the default, says so); chat then cannot be token-exact and is
refused with the reason. The servers' prefix-cache counters are scraped from ``/metrics``
(``--metrics-url``, default the base URLs) before and after the run, and each one's
running/waiting requests and KV usage every ``--sample-interval`` seconds during it
(per-instance busy fraction). Prints summary tables; ``--out`` writes the config, the
summary, every request and the samples as JSON, with the command and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shlex
import sys
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvcentric import __version__
from kvcentric.bench_serving import scrape, utilisation
from kvcentric.bench_serving.client import ENDPOINTS, Api
from kvcentric.bench_serving.metrics import format_table, summarize
from kvcentric.bench_serving.runner import FORMATS, ROUTINGS, RunConfig, Runner, prompt_kind
from kvcentric.bench_serving.tokens import TokenSource
from kvcentric.bench_serving.workloads import WORKLOADS, Workload, WorkloadSpec, build


def _rate(text: str) -> float | None:
    v = float(text)
    return None if math.isinf(v) else v


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    d = WorkloadSpec()
    g = ap.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default=d.workload)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--output-len", type=int, default=d.output_len)
    for name in ("num_users", "shared_system_prompt_len", "user_context_len", "turn_input_len",
                 "num_groups", "prompts_per_group", "input_len", "num_prompts"):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("turns_mean", "turns_std", "turn_gap", "hit_ratio", "time_scale",
                 "scale_tokens", "group_skew"):
        g.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    g.add_argument("--user-rate", type=_rate, default=None,
                   help="new users per second, Poisson (default: all start at once)")
    g.add_argument("--request-rate", type=_rate, default=None,
                   help="requests per second, Poisson (trace default: its timestamps)")
    g.add_argument("--trace", help="Mooncake-format JSONL trace (workload trace)")
    g.add_argument("--max-requests", type=int, default=None)
    g.add_argument("--max-input-len", type=int, default=None,
                   help="trace: skip requests longer than this (after --scale-tokens)")
    g.add_argument("--max-output-len", type=int, default=None,
                   help="trace: cap each request's output tokens (after --scale-tokens)")
    g.add_argument("--sample-sessions", type=float, default=None,
                   help="trace: keep this seeded fraction of conversations (whole)")


def add_client_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("client")
    g.add_argument("--base-url", nargs="+", action="extend", dest="base_urls")
    g.add_argument("--model", help="served model name (default: the first of /v1/models)")
    g.add_argument("--tokenizer", required=True, help="model folder with the tokenizer")
    g.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions")
    g.add_argument("--prompt-format", choices=FORMATS, default="auto",
                   help="completions prompts as text or token ids (auto: text where the "
                        "tokenizer makes token-exact text, else ids)")
    g.add_argument("--routing", choices=ROUTINGS, default="round-robin")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--retry-429", type=int, default=0, metavar="N",
                   help="resend a 429 after its Retry-After up to N times (as the OpenAI "
                        "SDK does); TTFT counts from the first attempt")
    g.add_argument("--no-ignore-eos", action="store_true")
    g.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into bodies")
    g.add_argument("--metrics-url", nargs="+", action="extend", dest="metrics_urls",
                   help="servers whose /metrics to scrape (default: the base URLs)")
    g.add_argument("--sample-interval", type=float, default=0.5, metavar="S",
                   help="seconds between /metrics samples of each instance's load (0: off)")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--label", default=None)
    g.add_argument("--out", type=Path, default=None)
    g.add_argument("--disable-tqdm", action="store_true")


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(**{f.name: getattr(args, f.name) for f in fields(WorkloadSpec)})


def served_model(base_url: str) -> str:
    import httpx

    r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def run_config(args: argparse.Namespace) -> RunConfig:
    urls = tuple(args.base_urls or ["http://127.0.0.1:8000"])
    api = Api(args.model or served_model(urls[0]), args.endpoint, not args.no_ignore_eos,
              dict(args.extra_body))
    return RunConfig(urls, api, args.prompt_format, args.routing, args.max_concurrency,
                     args.request_timeout, args.retry_429)


def benchmark(src: TokenSource, workload: Workload, cfg: RunConfig,
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
              metrics_urls: list[str] | None = None, label: str | None = None,
              progress: bool = True, sample_interval_s: float = 0.5) -> dict[str, Any]:
    """Run ``workload`` once and return the result document (what ``--out`` holds).

    ``sample_interval_s`` > 0 samples each metrics URL's load during the run.
    """
    urls = list(metrics_urls or cfg.base_urls)
    kind = prompt_kind(src, cfg.api.endpoint, cfg.prompt_format)
    if cfg.prompt_format == "auto" and kind == "ids":
        print(f"note: {src.text_problem}; sending token-id prompts on /v1/completions")
    sampler = utilisation.Sampler(urls, sample_interval_s) if sample_interval_s > 0 else None
    with tqdm(total=workload.num_requests, desc=label or workload.name,
              disable=not progress) as bar:
        runner = Runner(src, cfg, bar)
        before = scrape.scrape(urls)
        with sampler or contextlib.nullcontext():
            res = asyncio.run(runner.run(workload))
        after = scrape.scrape(urls)
    server = scrape.delta(before, after)
    summary = summarize(res.records, res.duration_s, slo_ttft_ms, slo_tpot_ms,
                        server["hit_tokens"])
    summary["aborted_turns"] = res.aborted_turns
    samples = (sampler.window(res.t_origin, res.t_origin + res.duration_s)
               if sampler is not None else {})
    return {
        "benchmark": "serving", "label": label or workload.name,
        "config": {"base_urls": list(cfg.base_urls), "api": asdict(cfg.api),
                   "prompt_format": kind, "prompt_format_requested": cfg.prompt_format,
                   "routing": cfg.routing, "max_concurrency": cfg.max_concurrency,
                   "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
                   "tokenizer": src.path, "text_problem": src.text_problem,
                   "metrics_urls": urls, "sample_interval_s": sample_interval_s},
        "workload": {"name": workload.name, "sessions": len(workload.sessions),
                     "requests": workload.num_requests, **workload.info},
        "summary": summary, "server_metrics": server,
        "utilisation": utilisation.summarise(samples, sample_interval_s) if samples else None,
        "warmup_errors": res.warmup_errors, "t_origin": res.t_origin,
        "requests": [asdict(r) for r in res.records], "utilisation_samples": samples,
    }


def build_parser(prog: str = "python -m kvcentric.bench_serving") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog,
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_client_args(ap)
    add_workload_args(ap)
    return ap


def run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """Build the workload ``args`` name and run it; a bad argument exits through
    ``ap.error``. Returns the result document with its summary ``table``."""
    import httpx

    try:
        spec = workload_spec(args)
        cfg = run_config(args)
        src = TokenSource(args.tokenizer)
        prompt_kind(src, cfg.api.endpoint, cfg.prompt_format)
        workload = build(spec, src)
    except (ValueError, OSError, httpx.HTTPError) as e:
        ap.error(str(e))
    result = benchmark(src, workload, cfg, args.slo_ttft_ms, args.slo_tpot_ms,
                       args.metrics_urls, args.label, not args.disable_tqdm,
                       args.sample_interval)
    result["config"]["workload"] = asdict(spec)
    table = format_table(result["summary"])
    if result["utilisation"]:
        table += "\n" + utilisation.format_table(result["utilisation"])
    result["table"] = table
    return result


def main(argv: list[str] | None = None, prog: str = "python -m kvcentric.bench_serving") -> int:
    """The command line: prints the summary tables; ``--out`` writes the result JSON
    (with the command and the machine). Exit 0 when any request completed."""
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    result = run(ap, args)
    print(result["table"])
    if args.out:
        result["command"] = shlex.join([ap.prog, *(sys.argv[1:] if argv is None else argv)])
        result["machine"] = {"platform": platform.platform(), "python": platform.python_version(),
                             "cpus": os.cpu_count(), "kvcentric": __version__}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0 if result["summary"]["completed"] else 1
