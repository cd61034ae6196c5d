"""How do routers and caches compare side by side: same instances, same workload, one run?

Side-by-side serving comparisons: every arm in one run, same instances, same workload.

    python -m benchmarks.serving.compare reuse   [--quick] [--users N] [--turns N] ...
    python -m benchmarks.serving.compare routing [--quick] ...
    python -m benchmarks.serving.compare trace   [--quick] [--sample-sessions F] ...
    python -m benchmarks.serving.compare hotprefix [--quick] [--groups N] [--rate R] ...

Each writes ``benchmarks/results/compare_<name>{_quick}.json`` (every arm's full result),
``.md`` (table and ratios over the baseline arm) and ``_ttft_cdf.png`` /
``_throughput.png`` / ``_utilisation.png`` (each instance's load per arm, sampled from
``/metrics``). Instances: vLLM CPU with the ``bench`` model, worker threads pinned
alike in every arm (``VLLM_CPU_NUM_OF_RESERVED_CPU``), each instance's worker on cores of
its own when the machine has a core to spare for everything else (``--cores auto``:
separate processors, as engines on separate GPUs), else vLLM's binding (``shared``: every
worker on the same cores, the router told they share one processor), each engine's own KV cache
holding a fraction of the active users' histories (``--engine-cache-tokens``, default
8192 tokens) as a GPU's HBM does in production (``0`` keeps vLLM's CPU default of 1 GiB,
which holds every history here). Every instance is warmed up with one unrelated request.

``reuse``: the multi-turn workload (chat endpoint) on 2 instances, requests round-robin
over the two (a user's next turn often lands on the instance that did not serve its last
one), users thinking between turns. Arms, one after the other on fresh instances:
``vllm-prefix-cache`` (no connector: each instance reuses what its own cache still holds)
and ``kvcentric`` (our connector on both over one 2 GB local store: every full block
either instance computed, prompts and answers, is loadable by both).

``routing``, ``trace`` and ``hotprefix`` run their arms one after the other on the same 2
instances (connector + one store; store and engine prefix caches emptied before every
arm): client-side round-robin, the peer routers' ``cache_aware`` policies
(``sglang-router``; the SGLang Model Gateway ``smg`` and ``vllm-router``, each from its
own venv under ``.peers/``), and our router three ways (cost profile fitted on the
instances first): ``kvcentric-router``, ``kvcentric-replicate`` (hot-prefix replication on)
and ``kvcentric-admission`` (``slo.reject: true`` with the benchmark's SLO, clients
retrying a 429 after its ``Retry-After``). ``routing``: the multi-turn workload (plus
``sglang-router`` ``round_robin``). ``trace``: the conversation trace, a seeded sample of
whole conversations, scaled down in tokens and time. ``hotprefix``: one (or a few) long
shared prefixes, many users' questions after it at a Poisson rate.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.lib import results_writer
from benchmarks.lib.paths import RESULTS, ROOT
from benchmarks.serving import report
from benchmarks.serving.fleet import (
    CPU_PAGE,
    SERVED_NAME,
    SERVER_ARGS,
    Arm,
    FleetSpec,
    engine_cache_args,
    engine_cache_text,
    fleet,
    own_cores_env,
    pinned_threads_env,
    reset_caches,
)
from benchmarks.serving.gateways import PEERS, gateway_for
from kvcentric.bench_serving.client import Api
from kvcentric.bench_serving.loadgen import benchmark
from kvcentric.bench_serving.runner import RunConfig
from kvcentric.bench_serving.tokens import TokenSource
from kvcentric.bench_serving.workloads import Workload, WorkloadSpec, build
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import VllmServer, connector_config

TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"


def common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="a small smoke run")
    ap.add_argument("--engine-cache-tokens", type=int, default=8192,
                    help="KV cache per instance, in tokens (0: vLLM's default, 1 GiB)")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=250.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="suffix of the result files' names")
    ap.add_argument("--router-health-s", type=float, default=None,
                    help="our router's health/metrics poll interval (default: its own, 1 s)")
    ap.add_argument("--cores", choices=("auto", "separate", "shared"), default="auto",
                    help="each instance's worker on cores of its own (separate processors, "
                         "as on separate GPUs; one core stays for everything else), or "
                         "vLLM's binding (every instance on the same cores); auto: separate "
                         "when there are cores enough")


def multi_turn_args(ap: argparse.ArgumentParser) -> None:
    common_args(ap)
    ap.add_argument("--users", type=int, default=None)
    ap.add_argument("--turns", type=float, default=None)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--context-len", type=int, default=1024)
    ap.add_argument("--turn-input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--turn-gap", type=float, default=None, help="think time (s)")
    ap.add_argument("--user-rate", type=float, default=None, help="new users per second")


def multi_turn_spec(args: argparse.Namespace, users: int, turns: float, gap: float,
                    rate: float) -> WorkloadSpec:
    """The multi-turn workload; explicit flags override the per-comparison defaults."""
    return WorkloadSpec(workload="multi-turn", seed=args.seed, num_users=args.users or users,
                        turns_mean=args.turns or turns, shared_system_prompt_len=args.system_len,
                        user_context_len=args.context_len, turn_input_len=args.turn_input_len,
                        output_len=args.output_len, user_rate=args.user_rate or rate,
                        turn_gap=gap if args.turn_gap is None else args.turn_gap)


def fleet_spec(args: argparse.Namespace, model: str, longest: int) -> FleetSpec:
    own = own_cores_env(2) if args.cores != "shared" else None
    if own is None and args.cores == "separate":
        raise SystemExit(f"--cores separate needs 3 cores or more, this machine has "
                         f"{len(os.sched_getaffinity(0))}")
    return FleetSpec(model, max_model_len=(longest // 512 + 2) * 512, env=pinned_threads_env(),
                     args=(*SERVER_ARGS, *engine_cache_args(args.engine_cache_tokens)),
                     instance_env=own or ())


def router_compute(fspec: FleetSpec) -> str | None:
    """What our router is told the instances compute on: each its own processor when
    they have cores of their own, else one shared."""
    return None if fspec.instance_env else "host-cpu"


def multi_turn_fleet(args: argparse.Namespace, spec: WorkloadSpec) -> tuple[str, FleetSpec]:
    """The ``bench`` model's folder and a fleet whose context fits the longest
    conversation of ``spec`` (turns up to mean + 3 std, 16 tokens of chat template each)."""
    model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    longest = spec.shared_system_prompt_len + spec.user_context_len + round(
        spec.turns_mean + 3 * spec.turns_std) * (spec.turn_input_len + spec.output_len + 16)
    return model, fleet_spec(args, model, longest)


def fleet_note(fspec: FleetSpec, args: argparse.Namespace, routing: str) -> str:
    return (f"Instances: {fspec.instances} x vLLM CPU, bench model ({fspec.dtype}), "
            f"max_model_len {fspec.max_model_len}, env {fspec.env}, per instance "
            f"{list(fspec.instance_env) or 'the same cores'}, engine KV cache "
            f"{engine_cache_text(args.engine_cache_tokens)}; {routing}.")


def slo_note(args: argparse.Namespace, t0: float) -> str:
    return (f"SLO: TTFT <= {args.slo_ttft_ms:.0f} ms and TPOT <= {args.slo_tpot_ms:.0f} ms. "
            f"Wall time of the whole comparison: {time.monotonic() - t0:.0f} s.")


def new_store() -> dict[str, Any]:
    return {"name": f"cmp-{uuid.uuid4().hex[:8]}", "capacity": "2gb"}


# ------------------------------------------------------------------------------- reuse

def reuse(args: argparse.Namespace) -> dict[str, Any]:
    """Multi-turn reuse: vLLM prefix cache alone vs kvcentric's store, 2 instances."""
    q = args.quick
    spec = multi_turn_spec(args, 4 if q else 16, 3 if q else 5, 2.0 if q else 10.0,
                           0.5 if q else 0.12)
    model, fspec = multi_turn_fleet(args, spec)
    store = new_store()
    arms = [Arm("vllm-prefix-cache"), Arm("kvcentric", connector_config(store), store)]
    src = TokenSource(model)
    workload = build(spec, src)
    logs = Path(tempfile.mkdtemp(prefix="kvc-compare-reuse-"))
    print(f"{workload.num_requests} requests from {spec.num_users} users; logs in {logs}")
    results, t0 = [], time.monotonic()
    for arm in arms:
        with fleet(fspec, arm, logs) as servers:
            cfg = RunConfig(tuple(s.url for s in servers), Api(SERVED_NAME, "chat"))
            res = benchmark(src, workload, cfg, args.slo_ttft_ms, args.slo_tpot_ms,
                            label=arm.name)
        res["same_instance_rate"] = report.same_instance_rate(res["requests"])
        results.append(res)
    same = ", ".join(f"{r['label']} {report.fmt(r['same_instance_rate'], '.0%')}"
                     for r in results)
    notes = [f"Workload: {asdict(spec)}.",
             fleet_note(fspec, args, "requests round-robin over the instances; follow-up "
                        f"turns on the instance of the user's previous turn: {same}"),
             "Arms run one after the other, each on freshly started instances.",
             slo_note(args, t0)]
    return report.write(RESULTS, "compare_reuse" + ("_quick" if q else "") + args.tag,
                        "Reuse: vLLM prefix cache alone vs kvcentric store (multi-turn)",
                        results, "vllm-prefix-cache",
                        {"workload": asdict(spec), "fleet": asdict(fspec)}, notes,
                        args.cmdline)


# ----------------------------------------------------------- routers over shared instances

def router_profile(server: VllmServer, model: str, logs: Path) -> str:
    """Fit our router's cost profile on one instance (``router.cli profile``); its path."""
    out = logs / "router-profile.json"
    subprocess.run([sys.executable, "-m", "kvcentric.router.cli", "profile", "--url", server.url,
                    "--model", SERVED_NAME, "--out", str(out), "--lengths", "256,1024,2048",
                    "--repeats", "1", "--page", str(CPU_PAGE), "--block-size", "256",
                    "--model-dir", model, "--kv-dtype", "bfloat16", "--store-tokens", "1024"],
                   check=True, timeout=600)
    return str(out)


def behind_gateways(args: argparse.Namespace, fspec: FleetSpec, arms: list[Arm],
                    workload: Workload, src: TokenSource, endpoint: str,
                    logs: Path) -> list[dict[str, Any]]:
    """Run every arm on the same instances (connector + one store), cold caches each time."""
    store = new_store()
    shared = Arm("shared", connector_config(store), store)
    results = []
    with fleet(fspec, shared, logs) as servers:
        urls = [s.url for s in servers]
        profile = (router_profile(servers[0], fspec.model, logs)
                   if any(a.gateway == "kvcentric" for a in arms) else None)
        for arm in arms:
            reset_caches(servers, store)
            gw = gateway_for(arm.gateway, urls, logs, model=SERVED_NAME, tokenizer=fspec.model,
                             store=store, slo_ttft_ms=args.slo_ttft_ms,
                             slo_tpot_ms=args.slo_tpot_ms, profile=profile, dtype=fspec.dtype,
                             compute=router_compute(fspec), health_s=args.router_health_s,
                             **arm.gateway_opts)
            try:
                base = [gw.start().wait_ready().url] if gw else urls
                cfg = RunConfig(tuple(base), Api(SERVED_NAME, endpoint),
                                retry_429=arm.retry_429)
                res = benchmark(src, workload, cfg, args.slo_ttft_ms, args.slo_tpot_ms,
                                metrics_urls=urls, label=arm.name)
            finally:
                if gw is not None:
                    gw.stop()
            results.append(res)
    return results


# Our router is told what the instances compute on (router_compute). Admission control is
# off in the first arms (the benchmark's users end their conversation on a refused turn);
# the admission arm's clients retry a 429 after its Retry-After, as the OpenAI SDK does.
OUR_ROUTER = Arm("kvcentric-router", gateway="kvcentric", gateway_opts={"reject": False})
OUR_ARMS = [OUR_ROUTER,
            Arm("kvcentric-replicate", gateway="kvcentric",
                gateway_opts={**OUR_ROUTER.gateway_opts, "replication": True}),
            Arm("kvcentric-admission", gateway="kvcentric",
                gateway_opts={**OUR_ROUTER.gateway_opts, "reject": True}, retry_429=4)]
OUR_ROUTER_NOTE = ("kvcentric-router: told the instances' processors (`compute`: one shared "
                   "with `--cores shared`, else each its own), `slo.reject: false` (no 429s: "
                   "a refused turn ends the user's conversation); its cost profile is fitted "
                   "on instance 0 first; `replication.enabled: false` (Algorithm 1 alone). "
                   "kvcentric-replicate: the same with replication on, the router's default "
                   "(hot prefixes warmed on idle instances). kvcentric-admission: "
                   "`slo.reject: true`, the benchmark's SLO as the router's; its clients "
                   "resend a 429 after its Retry-After up to 4 times, TTFT counting the "
                   "waits.")
# Our router running its baseline policies (kvcentric.router.policies) instead of
# Algorithm 1, everything else as OUR_ROUTER: on request (--arms), not in the defaults.
POLICY_ARMS = [Arm(f"kvcentric-{p}", gateway="kvcentric",
                   gateway_opts={**OUR_ROUTER.gateway_opts, "policy": p})
               for p in ("round_robin", "random", "least_loaded", "engine_cache")]
# The peer routers' cache-aware policies, each with its defaults otherwise.
PEER_CACHE_AWARE = [Arm("sglang-cache_aware", gateway="sglang:cache_aware"),
                    Arm("smg-cache_aware", gateway="smg:cache_aware"),
                    Arm("vllm-router-cache_aware", gateway="vllm-router:cache_aware")]
PEERS_NOTE = ("Peer routers, defaults but for the policy, every listener on 127.0.0.1: "
              f"sglang-router (project venv), {', '.join(PEERS.values())} (each in its "
              "own venv under .peers/); smg in HTTP mode with the model's folder as "
              "`--tokenizer-path`; vllm-router's cache_aware first asks every instance for "
              "`/v1/(chat/)completions/render` (vLLM answers 403 without "
              "`--enable-scale-out`), then routes on the request text.")
ROUTING_ARMS = [Arm("round-robin"), Arm("sglang-round_robin", gateway="sglang:round_robin"),
                *PEER_CACHE_AWARE, *OUR_ARMS]


def routing(args: argparse.Namespace) -> dict[str, Any]:
    """Routing: round-robin, the peer routers (sglang-router both policies, smg and
    vllm-router cache_aware), our router; same instances."""
    q = args.quick
    spec = multi_turn_spec(args, 4 if q else 12, 3 if q else 4, 2.0 if q else 8.0,
                           0.5 if q else 0.15)
    model, fspec = multi_turn_fleet(args, spec)
    src = TokenSource(model)
    workload = build(spec, src)
    logs = Path(tempfile.mkdtemp(prefix="kvc-compare-routing-"))
    print(f"{workload.num_requests} requests from {spec.num_users} users; logs in {logs}")
    t0 = time.monotonic()
    results = behind_gateways(args, fspec, ROUTING_ARMS, workload, src, "chat", logs)
    notes = [f"Workload: {asdict(spec)}.",
             fleet_note(fspec, args, "all arms on the same instances, each with the "
                        "kvcentric connector over one local store, emptied (store and "
                        "engine prefix caches) before every arm"),
             OUR_ROUTER_NOTE, PEERS_NOTE, slo_note(args, t0)]
    return report.write(RESULTS, "compare_routing" + ("_quick" if q else "") + args.tag,
                        "Routing: round-robin vs peer routers vs kvcentric router",
                        results, "round-robin",
                        {"workload": asdict(spec), "fleet": asdict(fspec)}, notes,
                        args.cmdline)


# ------------------------------------------------------------------------------- trace

def trace_args(ap: argparse.ArgumentParser) -> None:
    common_args(ap)
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--max-requests", type=int, default=8000, help="trace lines read")
    ap.add_argument("--sample-sessions", type=float, default=0.02)
    ap.add_argument("--scale-tokens", type=float, default=1 / 16)
    ap.add_argument("--time-scale", type=float, default=0.075)
    ap.add_argument("--max-input-len", type=int, default=3000)


def trace(args: argparse.Namespace) -> dict[str, Any]:
    """Trace replay (conversation trace, scaled): the peers' cache_aware vs ours."""
    q = args.quick
    spec = WorkloadSpec(workload="trace", seed=args.seed, trace=args.trace,
                        max_requests=2000 if q else args.max_requests,
                        sample_sessions=args.sample_sessions, scale_tokens=args.scale_tokens,
                        time_scale=args.time_scale, max_input_len=args.max_input_len)
    model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    fspec = fleet_spec(args, model, args.max_input_len + 256)
    src = TokenSource(model)
    workload = build(spec, src)
    logs = Path(tempfile.mkdtemp(prefix="kvc-compare-trace-"))
    print(f"{workload.num_requests} requests, {workload.info}; logs in {logs}")
    arms = [Arm("round-robin"), *PEER_CACHE_AWARE, *OUR_ARMS]
    t0 = time.monotonic()
    results = behind_gateways(args, fspec, arms, workload, src, "completions", logs)
    notes = [f"Workload: {asdict(spec)}; {workload.info}.",
             fleet_note(fspec, args, "all arms on the same instances with the kvcentric "
                        "connector over one local store, emptied before every arm"),
             OUR_ROUTER_NOTE, PEERS_NOTE, slo_note(args, t0)]
    return report.write(RESULTS, "compare_trace" + ("_quick" if q else "") + args.tag,
                        "Trace replay (conversation, scaled): peer routers vs kvcentric",
                        results, "round-robin",
                        {"workload": asdict(spec), "fleet": asdict(fspec)}, notes,
                        args.cmdline)


# ------------------------------------------------------------------------ hot prefix

def hotprefix_args(ap: argparse.ArgumentParser) -> None:
    common_args(ap)
    ap.add_argument("--groups", type=int, default=1, help="hot shared prefixes")
    ap.add_argument("--prompts", type=int, default=None, help="requests per prefix")
    ap.add_argument("--system-len", type=int, default=3072)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--rate", type=float, default=None, help="requests per second")


HOTPREFIX_ARMS = [Arm("round-robin"), *PEER_CACHE_AWARE, *OUR_ARMS]


def hotprefix(args: argparse.Namespace) -> dict[str, Any]:
    """Hot shared prefix, many users: with and without hot-prefix replication."""
    q = args.quick
    spec = WorkloadSpec(workload="shared-prefix", seed=args.seed, num_groups=args.groups,
                        prompts_per_group=args.prompts or (24 if q else 120),
                        shared_system_prompt_len=args.system_len,
                        turn_input_len=args.question_len, output_len=args.output_len,
                        request_rate=args.rate or (1.0 if q else 1.5))
    model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    fspec = fleet_spec(args, model, args.system_len + args.question_len + args.output_len)
    src = TokenSource(model)
    workload = build(spec, src)
    logs = Path(tempfile.mkdtemp(prefix="kvc-compare-hotprefix-"))
    print(f"{workload.num_requests} requests over {spec.num_groups} prefixes; logs in {logs}")
    t0 = time.monotonic()
    results = behind_gateways(args, fspec, HOTPREFIX_ARMS, workload, src, "completions", logs)
    notes = [f"Workload: {asdict(spec)}.",
             fleet_note(fspec, args, "all arms on the same instances with the kvcentric "
                        "connector over one local store, emptied before every arm"),
             OUR_ROUTER_NOTE,
             PEERS_NOTE, slo_note(args, t0)]
    return report.write(RESULTS, "compare_hotprefix" + ("_quick" if q else "") + args.tag,
                        "Hot shared prefix: routers, with and without hot-prefix replication",
                        results, "round-robin",
                        {"workload": asdict(spec), "fleet": asdict(fspec)}, notes,
                        args.cmdline)


COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None],
                          Callable[[argparse.Namespace], dict[str, Any]]]] = {
    "reuse": (multi_turn_args, reuse),
    "routing": (multi_turn_args, routing),
    "trace": (trace_args, trace),
    "hotprefix": (hotprefix_args, hotprefix),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name, (add_args, run) in COMMANDS.items():
        add_args(sub.add_parser(name, help=(run.__doc__ or name).split("\n")[0]))
    args = ap.parse_args(argv)
    args.cmdline = results_writer.command_line(__file__, argv)
    COMMANDS[args.command][1](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
