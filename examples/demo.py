"""kvcentric demo: one multi-turn conversation, three ways, on two vLLM instances each.

    make demo        (or: .venv/bin/python -m examples.demo [--turns N] [--out FILE.json])

Starts the embedded local KV store, two vLLM CPU instances with the kvcentric connector,
two plain vLLM instances (prefix caching on) and the kvcentric router. A client holds one
conversation: a long system prompt, then turns that each resend the whole history plus
the previous answers. Three arms, the same conversation:

1. ``vLLM, round robin``: plain instances, turns alternate between them as a load
   balancer without session affinity would; every turn recomputes the history.
2. ``+ kvcentric store``: the connector instances, still round robin; each turn loads
   the history the other instance stored.
3. ``+ kvcentric router``: the same instances behind the router, which sends each turn
   where its prefix is cheapest (here: the instance that holds it in its engine cache).

Caches (engine and store) are emptied between arms 2 and 3. Prints TTFT per turn, the
means, and whether every arm generated the same tokens, and writes them with the command,
machine and commit to ``benchmarks/results/demo.json`` (README's demo numbers come from
it).
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS
from kvcentric.config import StoreConfig
from kvcentric.store import open_store
from kvcentric.store.local import launcher
from kvcentric.store.metrics import log_line
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import (
    VllmServer,
    connector_config,
    free_port,
    stop_group,
    stream_completion,
    wait_http,
)

Turn = tuple[int, float, list[int]]  # prompt tokens, TTFT s, answer


def conversation(send: Callable[[int, list[int]], tuple[float, list[int]]], turns: int,
                 system: list[int], seed: int) -> list[Turn]:
    """Run one conversation through ``send(turn, prompt)``; (prompt tokens, TTFT, answer)
    per turn."""
    rnd = random.Random(seed)
    history = list(system)
    rows = []
    for t in range(turns):
        history += [rnd.randrange(4, 8000) for _ in range(200)]  # the user's new message
        ttft, answer = send(t, history)
        rows.append((len(history), ttft, answer))
        history += answer
    return rows


def round_robin(servers: list[VllmServer], out_len: int) -> Callable[[int, list[int]],
                                                                     tuple[float, list[int]]]:
    return lambda t, prompt: servers[t % len(servers)].stream(prompt, max_tokens=out_len)


def start_router(model: str, servers: list[VllmServer], store: dict[str, str],
                 logs: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The kvcentric router over ``servers`` (default cost model, no profile run)."""
    port = free_port()
    cfg = {"model": "bench", "tokenizer": model, "listen": {"port": port}, "store": store,
           "instances": [{"url": s.url, "role": "both", "name": f"kvc{i}"}
                         for i, s in enumerate(servers)]}
    (logs / "router.yaml").write_text(yaml.safe_dump(cfg))
    log = logs / "router.log"
    proc = subprocess.Popen([sys.executable, "-m", "kvcentric.router.cli", "serve", "--config",
                             str(logs / "router.yaml")], stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc, log, 60)
    return proc, url


def main() -> None:
    ap = argparse.ArgumentParser(description="kvcentric multi-turn demo")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=1536)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", type=Path, default=RESULTS / "demo.json")
    args = ap.parse_args()
    t_start = time.monotonic()
    print("building the local bench model (random weights, no download) ...", flush=True)
    model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    store = {"name": f"demo-{uuid.uuid4().hex[:6]}", "capacity": "1gb"}
    logs = Path(".demo-logs")
    logs.mkdir(exist_ok=True)
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}  # same worker threads for every instance
    # float32: greedy tokens then match exactly between the arms. In bf16, KV an instance
    # computed while decoding differs by rounding from the same KV recomputed in prefill,
    # and the tiny random model's argmax flips on such near-ties (vLLM's own prefix cache
    # behaves the same way).
    common = {"model": model, "name": "bench", "dtype": "float32", "max_model_len": 8192,
              "env": env}
    kvc = [VllmServer(**common, kv_transfer=connector_config(store),  # type: ignore[arg-type]
                      log_path=logs / f"kvc{i}.log") for i in range(2)]
    plain = [VllmServer(**common, log_path=logs / f"plain{i}.log")  # type: ignore[arg-type]
             for i in range(2)]
    print("starting the store and 4 vLLM CPU instances (about a minute) ...", flush=True)
    router = None
    try:
        for s in kvc + plain:
            s.start()
        for s in kvc + plain:
            s.wait_ready(600)
        warm = [random.Random(7).randrange(4, 8000) for _ in range(256)]
        for s in kvc + plain:
            s.complete(warm, max_tokens=2, timeout_s=600)
        system = [random.Random(1).randrange(4, 8000) for _ in range(args.system_len)]
        print(f"running a {args.turns}-turn conversation three ways ...", flush=True)
        arms = {"vLLM, round robin": conversation(round_robin(plain, args.output_len),
                                                   args.turns, system, 2)}
        arms["+ kvcentric store"] = conversation(round_robin(kvc, args.output_len), args.turns,
                                                 system, 2)
        with open_store(store) as st:
            stats = st.stats()
            st.clear()  # type: ignore[attr-defined]
        for s in kvc:
            s.reset_prefix_cache()
        router, url = start_router(model, kvc, store, logs)
        print(f"router at {url}: live status page {url}/dashboard (open it while the "
              "conversation runs; /metrics and /instances show the decisions)", flush=True)
        arms["+ kvcentric router"] = conversation(
            lambda t, p: stream_completion(url, "bench", p, args.output_len, 300.0),
            args.turns, system, 2)
    finally:
        stop_group(router)
        for s in kvc + plain:
            s.stop()
        launcher.stop(StoreConfig.from_dict(store))
    doc = summary(arms)
    print(report(arms, stats, time.monotonic() - t_start))
    rw.write(args.out, {"benchmark": "demo", "title": "make demo: one conversation, three ways",
                        "turns": args.turns, "system_len": args.system_len,
                        "output_len": args.output_len, **doc},
             command=rw.command_line(__file__))


def summary(arms: dict[str, list[Turn]]) -> dict[str, Any]:
    """Per arm its TTFT per turn (ms) and the mean over turns 2.. (``later_mean_ms``), each
    arm's speedup over the first on those turns, and whether every arm gave the same
    tokens."""
    names = list(arms)
    later = {n: 1e3 * sum(r[1] for r in rows[1:]) / (len(rows) - 1) for n, rows in arms.items()}
    base = arms[names[0]]
    return {"arms": {n: {"ttft_ms": [1e3 * r[1] for r in rows], "later_mean_ms": later[n],
                         "prompt_tokens": [r[0] for r in rows]} for n, rows in arms.items()},
            "summary": {"later_mean_ms": later,
                        "speedup_over_first": {n: later[names[0]] / later[n]
                                               for n in names[1:]},
                        "tokens_identical": all([r[2] for r in rows] == [r[2] for r in base]
                                                for rows in arms.values())}}


def report(arms: dict[str, list[Turn]], stats: dict[str, int], elapsed: float) -> str:
    names = list(arms)
    base = arms[names[0]]
    s = summary(arms)["summary"]
    lines = [f"\n{'turn':>4} {'prompt':>7}" + "".join(f" {n:>20}" for n in names)]
    for t in range(len(base)):
        cells = "".join(f" {1e3 * arms[n][t][1]:>18.0f}ms" for n in names)
        lines.append(f"{t + 1:>4} {base[t][0]:>7}{cells}")
    lines.append(f"{'turns 2..':>12}"
                 + "".join(f" {s['later_mean_ms'][n]:>18.0f}ms" for n in names))
    for n in names[1:]:
        lines.append(f"{n}: turns 2..{len(base)} {s['speedup_over_first'][n]:.1f}x faster "
                     f"than {names[0]}")
    lines.append(f"identical tokens in every turn of every arm: {s['tokens_identical']}")
    lines.append(f"store after the round-robin arm: {log_line(stats)}")
    lines.append(f"demo finished in {elapsed:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
