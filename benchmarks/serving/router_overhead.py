"""What does the router add to a request's TTFT, next to going straight to the engine?

    python -m benchmarks.serving.router_overhead [--requests 60] [--words 3000,750]
                                               [--max-tokens 16] [--token-ms 0] [--engines 2]
                                               [--peers vllm-router:cache_aware,...] [--no-pin]
                                               [--out FILE.json]

``--engines`` stub engines (:mod:`benchmarks.lib.stub_engine`, one process: instant
answers, vLLM's ``/metrics`` gauges, and the connector's saves into a local store, so the
router's store view sees real residency) and the router in front of them
(``kvcentric.router.cli serve``, its own process, a local store). Per prompt size
(``--words`` words of text: the router tokenises them, as it does for every text prompt),
requests alternate between the stub directly (the baseline, same run) and the router;
each is a streamed ``/v1/completions`` of ``--max-tokens`` tokens (one SSE chunk each, as
vLLM streams: the router relays every one), ``--token-ms`` apart (an engine's time between
tokens: at 0 the chunks leave together and the router reads several at once, which a real
decode does not allow), and its TTFT is the time to the first SSE event. Also reported:
the router's CPU time per request, from ``/proc/PID/task/*/schedstat`` of its process
group over separate passes of router-only requests (the median of ``CPU_PASSES``).

``--peers``: peer routers (:func:`benchmarks.serving.gateways.gateway_for` kinds, e.g.
``vllm-router:cache_aware``, ``smg:cache_aware``) in front of the same stubs, measured the
same way in the same run, taking turns with ours request by request (TTFT) and pass by pass
(CPU): the baseline a router's hop is judged by.

``--pin`` (default with two or more CPUs): the router being measured runs alone on the
last CPU this process may use, and everything else (the client, the stubs, the store) on
the others. Unpinned, where the scheduler put the router beside the client or a stub moved
its CPU per request by tens of percent from one run to the next (caches, wake-ups), so
two runs of the same commit differed more than the changes being measured.

Engines here answer at once, so the difference is the router's own work (parse and
validate, tokenise, hash, look up the store, decide, relay) plus one proxy hop. The ratio
``router_p50 / direct_p50`` and the added milliseconds are what to compare across commits.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import yaml
from tqdm import tqdm

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS, module_command
from benchmarks.lib.procfs import group_cpu_seconds, pin_group
from benchmarks.serving.gateways import PEER_ROUTERS, Gateway, gateway_for, peer_name
from kvcentric.config import StoreConfig
from kvcentric.store.local import launcher
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import free_port, spawn, stop_group, wait_http

CPU_PASSES = 3  # passes of router-only requests whose CPU per request is the median
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta")


def ttft_ms(client: httpx.Client, base: str, prompt: str, max_tokens: int) -> float:
    """Milliseconds to the first SSE event of a streamed completion of ``prompt``; the
    rest of the stream is read to its end, and must be every token's event and
    ``[DONE]`` (a router that dropped or merged events would be measured doing less)."""
    t0 = time.perf_counter()
    first = None
    events = 0
    with client.stream("POST", base + "/v1/completions", json={
            "model": "bench", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:"):
                events += 1
                if first is None:
                    first = (time.perf_counter() - t0) * 1000
    if first is None or events != max_tokens + 1:
        raise RuntimeError(f"{base}: the stream carried {events} events, not "
                           f"{max_tokens} tokens and [DONE]")
    return first


Target = tuple[str, subprocess.Popen[bytes], str]  # a router: name, process, base URL


def measure(targets: list[Target], direct: str, words: int, n: int, max_tokens: int,
            bar: tqdm) -> list[dict[str, Any]]:
    """Every router at one prompt size, a row each: ``CPU_PASSES`` passes of ``n``
    requests per router, the routers taking turns within each pass, then ``n`` rounds of
    one request to ``direct`` (a stub) and one to each router. Taking turns puts the
    box's drift on every router alike, so the rows compare within the run."""
    rnd = random.Random(words)
    system = " ".join(rnd.choice(WORDS) for _ in range(words))

    def prompt() -> str:  # a shared prefix and a fresh question, as users send
        return system + " " + " ".join(rnd.choice(WORDS) for _ in range(40))

    cpu: dict[str, list[float]] = {name: [] for name, _, _ in targets}
    ttft: dict[str, list[float]] = {name: [] for name, _, _ in targets}
    d: list[float] = []
    with httpx.Client(timeout=60) as c:
        for _ in range(5):  # connections, the tokenizer's and the store's first calls
            ttft_ms(c, direct, prompt(), max_tokens)
            for _, _, url in targets:
                ttft_ms(c, url, prompt(), max_tokens)
        for _ in range(CPU_PASSES):  # the box's noise moves one pass by tens of percent
            for name, proc, url in targets:
                c0 = group_cpu_seconds([proc.pid])
                for _ in range(n):
                    ttft_ms(c, url, prompt(), max_tokens)
                cpu[name].append((group_cpu_seconds([proc.pid]) - c0) / n * 1000)
                bar.update(n)
        for _ in range(n):
            d.append(ttft_ms(c, direct, prompt(), max_tokens))
            for name, _, url in targets:
                ttft[name].append(ttft_ms(c, url, prompt(), max_tokens))
            bar.update(len(targets))
    dm = statistics.median(d)
    rows = []
    for name, _, _ in targets:
        r = ttft[name]
        rm = statistics.median(r)
        rows.append({"router": name, "words": words, "requests": n, "max_tokens": max_tokens,
                     "direct_p50_ms": dm, "router_p50_ms": rm,
                     "added_p50_ms": rm - dm, "router_over_direct": rm / dm,
                     "direct_mean_ms": statistics.mean(d), "router_mean_ms": statistics.mean(r),
                     "router_cpu_ms_per_request": statistics.median(cpu[name]),
                     "router_cpu_ms_per_request_passes": [round(x, 3) for x in cpu[name]]})
    return rows


def split_cpus(pin: bool) -> tuple[set[int], set[int]] | None:
    """``(routers, rest)``: the last CPU this process may use, and the others; None
    unpinned (``pin`` off, or a single CPU)."""
    own = sorted(os.sched_getaffinity(0))
    return ({own[-1]}, set(own[:-1])) if pin and len(own) > 1 else None


def run(args: argparse.Namespace, cpus: tuple[set[int], set[int]] | None
        ) -> list[dict[str, Any]]:
    """Every router measured; ``cpus``: :func:`split_cpus`'s answer (None: unpinned)."""
    if cpus is None:
        return _run(args, None)
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus[1])  # the store, stubs and client inherit it
    try:
        return _run(args, cpus[0])
    finally:
        os.sched_setaffinity(0, own)


def _run(args: argparse.Namespace, router_cpus: set[int] | None) -> list[dict[str, Any]]:
    model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rt = tempfile.mkdtemp(prefix="kvc-overhead-", dir="/dev/shm")
    store = {"name": f"ro{uuid.uuid4().hex[:6]}", "capacity": "256mb", "runtime_dir": rt}
    store_cfg = StoreConfig.from_dict(store)
    launcher.ensure_running(store_cfg)
    ports = [free_port() for _ in range(args.engines)]
    port = free_port()
    lat = args.token_ms * args.max_tokens
    cfg = {"model": "bench", "tokenizer": model, "listen": {"port": port}, "store": store,
           "log_level": "warning",
           "instances": [{"url": f"http://127.0.0.1:{p}", "role": "both", "name": f"e{i}"}
                         for i, p in enumerate(ports)]}
    cfg_path = logs / f"router-overhead-{port}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    stub = router = None
    peers: list[Gateway] = []
    try:
        stub = spawn(module_command("benchmarks.lib.stub_engine", "--ports",
                                    ",".join(map(str, ports)), "--model", "bench",
                                    "--tokenizer", model, "--store", json.dumps(store),
                                    "--stream-tokens", "--latency-ms",
                                    f"{lat},{lat}"),
                     logs / "router-overhead-stub.log")
        for p in ports:
            wait_http(f"http://127.0.0.1:{p}/health", stub, logs / "router-overhead-stub.log")
        router = spawn([sys.executable, "-m", "kvcentric.router.cli", "serve", "--config",
                        str(cfg_path)], logs / "router-overhead.log")
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", router, logs / "router-overhead.log")
        if router_cpus is not None:
            pin_group(router.pid, router_cpus)
        targets: list[Target] = [("kvcentric", router, url)]
        for kind in args.peers:
            g = gateway_for(kind, [f"http://127.0.0.1:{p}" for p in ports], logs,
                            tokenizer=model)
            assert g is not None, f"{kind}: not a router"
            peers.append(g)
            g.start().wait_ready()
            assert g.proc is not None
            if router_cpus is not None:
                pin_group(g.proc.pid, router_cpus)
            targets.append((g.name, g.proc, g.url))
        total = (1 + CPU_PASSES) * args.requests * len(args.words) * len(targets)
        with tqdm(total=total, desc="requests") as bar:
            rows = [row for w in args.words
                    for row in measure(targets, f"http://127.0.0.1:{ports[0]}", w,
                                       args.requests, args.max_tokens, bar)]
        # ours first, then each peer, each router's rows in --words order
        return sorted(rows, key=lambda r: [t[0] for t in targets].index(r["router"]))
    finally:
        for g in peers:
            g.stop()
        stop_group(router)
        stop_group(stub)
        launcher.stop(store_cfg)
        shutil.rmtree(rt, ignore_errors=True)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'router':<26} {'words':>6} {'direct p50':>10} {'router p50':>10} {'added':>7} "
             f"{'ratio':>6} {'router CPU/req':>14}"]
    lines += [f"{r['router']:<26} {r['words']:>6} {r['direct_p50_ms']:>10.1f} "
              f"{r['router_p50_ms']:>10.1f} {r['added_p50_ms']:>7.1f} "
              f"{r['router_over_direct']:>6.2f} {r['router_cpu_ms_per_request']:>12.1f}ms"
              for r in rows]
    return "\n".join(lines)


def per_size(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """One router's added TTFT p50 and CPU per request, by prompt size (words)."""
    return {"added_p50_ms": {str(r["words"]): round(r["added_p50_ms"], 2) for r in rows},
            "router_cpu_ms_per_request": {
                str(r["words"]): round(r["router_cpu_ms_per_request"], 2) for r in rows}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=60, help="timed requests per arm and size")
    ap.add_argument("--words", type=lambda s: [int(x) for x in s.split(",")],
                    default=[3000, 750], help="prompt sizes in words (comma-separated)")
    ap.add_argument("--max-tokens", type=int, default=16,
                    help="tokens per answer, each one SSE chunk the router relays")
    ap.add_argument("--engines", type=int, default=2,
                    help="stub engines behind every router (their health and metrics "
                         "polls, and the decision over them, are the router's work too)")
    ap.add_argument("--token-ms", type=float, default=0.0,
                    help="milliseconds between an answer's tokens")
    ap.add_argument("--peers", type=lambda s: [x for x in s.split(",") if x], default=[],
                    help="peer routers measured beside ours (e.g. vllm-router:cache_aware)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="the measured router alone on one CPU, the rest on the others "
                         "(with two or more CPUs)")
    ap.add_argument("--out", type=Path, default=RESULTS / "router_overhead.json")
    args = ap.parse_args(argv)
    if min(args.requests, args.max_tokens, args.engines, *args.words) < 1:
        ap.error("--requests, --max-tokens, --engines and --words must be positive")
    if args.token_ms < 0:
        ap.error("--token-ms must not be negative")
    unknown = [p for p in args.peers if peer_name(p) is None]
    if unknown:
        ap.error(f"--peers {','.join(unknown)}: a peer is one of "
                 f"{', '.join(k + ':POLICY' for k in PEER_ROUTERS)}")
    cpus = split_cpus(args.pin)
    rows = run(args, cpus)
    doc = {"benchmark": "router_overhead", "rows": rows,
           "summary": {"max_tokens": args.max_tokens, "token_ms": args.token_ms,
                       "engines": args.engines,
                       "router_cpus": sorted(cpus[0]) if cpus else None,
                       **per_size([r for r in rows if r["router"] == "kvcentric"]),
                       "peers": {p: per_size([r for r in rows if r["router"] == p])
                                 for p in dict.fromkeys(r["router"] for r in rows)
                                 if p != "kvcentric"}}}
    rw.write(args.out, doc, table=table(rows), command=rw.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
