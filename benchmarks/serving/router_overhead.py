"""What does the router add to a request's TTFT, next to going straight to the engine?

What the router adds to a request: streamed TTFT through it vs straight to the engine.

    python -m benchmarks.serving.router_overhead [--requests 60] [--words 3000,750]
                                               [--out FILE.json]

Two stub engines (:mod:`benchmarks.lib.stub_engine`: instant answers, vLLM's ``/metrics``
gauges, and the connector's saves into a local store, so the router's store view sees real
residency) and the router in front of them (``kvcentric.router.cli serve``, its own
process, a local store). Per prompt size (``--words`` words of text: the router tokenises
them, as it does for every text prompt), requests alternate between the stub directly (the
baseline, same run) and the router; each is a streamed ``/v1/completions`` and its TTFT is
the time to the first SSE event. Also reported: the router's CPU time per request, from
``/proc/PID/task/*/schedstat`` over separate passes of router-only requests (the median
of ``CPU_PASSES``).

Engines here answer at once, so the difference is the router's own work (parse and
validate, tokenise, hash, look up the store, decide, relay) plus one proxy hop. The ratio
``router_p50 / direct_p50`` and the added milliseconds are what to compare across commits.
"""

from __future__ import annotations

import argparse
import json
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
from benchmarks.lib.procfs import cpu_seconds
from kvcentric.config import StoreConfig
from kvcentric.store.local import launcher
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import free_port, spawn, stop_group, wait_http

CPU_PASSES = 3  # passes of router-only requests whose CPU per request is the median
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta")


def ttft_ms(client: httpx.Client, base: str, prompt: str) -> float:
    """Milliseconds to the first SSE event of a streamed completion of ``prompt``."""
    t0 = time.perf_counter()
    with client.stream("POST", base + "/v1/completions", json={
            "model": "bench", "prompt": prompt, "max_tokens": 16, "stream": True,
            "temperature": 0.0}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:"):
                return (time.perf_counter() - t0) * 1000
    raise RuntimeError(f"{base}: the stream carried no event")


def measure(router: subprocess.Popen[bytes], url: str, direct: str, words: int, n: int,
            bar: tqdm) -> dict[str, Any]:
    rnd = random.Random(words)
    system = " ".join(rnd.choice(WORDS) for _ in range(words))

    def prompt() -> str:  # a shared prefix and a fresh question, as users send
        return system + " " + " ".join(rnd.choice(WORDS) for _ in range(40))

    with httpx.Client(timeout=60) as c:
        for _ in range(5):  # connections, the tokenizer's and the store's first calls
            ttft_ms(c, url, prompt())
            ttft_ms(c, direct, prompt())
        cpu = []
        for _ in range(CPU_PASSES):  # the box's noise moves one pass by tens of percent
            c0 = cpu_seconds(router.pid)
            for _ in range(n):
                ttft_ms(c, url, prompt())
            bar.update(n)
            cpu.append((cpu_seconds(router.pid) - c0) / n * 1000)
        cpu_ms = statistics.median(cpu)
        d, r = [], []
        for _ in range(n):
            d.append(ttft_ms(c, direct, prompt()))
            r.append(ttft_ms(c, url, prompt()))
            bar.update()
    dm, rm = statistics.median(d), statistics.median(r)
    return {"words": words, "requests": n, "direct_p50_ms": dm, "router_p50_ms": rm,
            "added_p50_ms": rm - dm, "router_over_direct": rm / dm,
            "direct_mean_ms": statistics.mean(d), "router_mean_ms": statistics.mean(r),
            "router_cpu_ms_per_request": cpu_ms,
            "router_cpu_ms_per_request_passes": [round(x, 3) for x in cpu]}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rt = tempfile.mkdtemp(prefix="kvc-overhead-", dir="/dev/shm")
    store = {"name": f"ro{uuid.uuid4().hex[:6]}", "capacity": "256mb", "runtime_dir": rt}
    store_cfg = StoreConfig.from_dict(store)
    launcher.ensure_running(store_cfg)
    ports = [free_port(), free_port()]
    port = free_port()
    cfg = {"model": "bench", "tokenizer": model, "listen": {"port": port}, "store": store,
           "log_level": "warning",
           "instances": [{"url": f"http://127.0.0.1:{p}", "role": "both", "name": f"e{i}"}
                         for i, p in enumerate(ports)]}
    cfg_path = logs / f"router-overhead-{port}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    stub = router = None
    try:
        stub = spawn(module_command("benchmarks.lib.stub_engine", "--ports",
                                    ",".join(map(str, ports)), "--model", "bench",
                                    "--tokenizer", model, "--store", json.dumps(store)),
                     logs / "router-overhead-stub.log")
        for p in ports:
            wait_http(f"http://127.0.0.1:{p}/health", stub, logs / "router-overhead-stub.log")
        router = spawn([sys.executable, "-m", "kvcentric.router.cli", "serve", "--config",
                        str(cfg_path)], logs / "router-overhead.log")
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", router, logs / "router-overhead.log")
        total = (1 + CPU_PASSES) * args.requests * len(args.words)
        with tqdm(total=total, desc="requests") as bar:
            return [measure(router, url, f"http://127.0.0.1:{ports[0]}", w, args.requests, bar)
                    for w in args.words]
    finally:
        stop_group(router)
        stop_group(stub)
        launcher.stop(store_cfg)
        shutil.rmtree(rt, ignore_errors=True)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'words':>6} {'direct p50':>10} {'router p50':>10} {'added':>7} {'ratio':>6} "
             f"{'router CPU/req':>14}"]
    lines += [f"{r['words']:>6} {r['direct_p50_ms']:>10.1f} {r['router_p50_ms']:>10.1f} "
              f"{r['added_p50_ms']:>7.1f} {r['router_over_direct']:>6.2f} "
              f"{r['router_cpu_ms_per_request']:>12.1f}ms" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=60, help="timed requests per arm and size")
    ap.add_argument("--words", type=lambda s: [int(x) for x in s.split(",")],
                    default=[3000, 750], help="prompt sizes in words (comma-separated)")
    ap.add_argument("--out", type=Path, default=RESULTS / "router_overhead.json")
    args = ap.parse_args(argv)
    if args.requests < 1 or any(w < 1 for w in args.words):
        ap.error("--requests and --words must be positive")
    rows = run(args)
    doc = {"benchmark": "router_overhead", "rows": rows,
           "summary": {"added_p50_ms": {str(r["words"]): round(r["added_p50_ms"], 2)
                                        for r in rows},
                       "router_cpu_ms_per_request": {
                           str(r["words"]): round(r["router_cpu_ms_per_request"], 2)
                           for r in rows}}}
    rw.write(args.out, doc, table=table(rows), command=rw.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
