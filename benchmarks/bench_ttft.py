"""TTFT: recompute vs store hit vs the engine's own prefix-cache hit, and TTFT vs hit ratio.

    python benchmarks/bench_ttft.py [--quick] [--out FILE.json]

Two vLLM CPU servers with the ``bench`` model, started in this run, both pinned to the
same worker thread count (``VLLM_CPU_NUM_OF_RESERVED_CPU``; on 2 cores vLLM otherwise
gives a connector-enabled worker 2 threads and a plain one 1):

- ``plain``: no connector. Miss = a never-seen prompt; engine hit = the same prompt again.
- ``kvc``: kvcentric connector on a local store. Store hit = a prompt this server stored,
  after ``/reset_prefix_cache`` (so only the store can supply it: the server is as fresh
  as a new instance for that prompt). Hit-ratio sweep: a prefix of r x L tokens is stored,
  then a prompt of L tokens starting with it is timed.

TTFT is the latency of a ``max_tokens=1`` completion (prefill + first token), median of
``--reps`` fresh prompts. Everything is compared in ratios within this run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvcentric.config import StoreConfig  # noqa: E402
from kvcentric.store.local import launcher  # noqa: E402
from kvcentric.testing.models import build_model  # noqa: E402
from kvcentric.testing.servers import VllmServer, connector_config  # noqa: E402

RESULTS = Path(__file__).parent / "results"
RATIOS = (0.0, 0.2, 0.4, 0.6, 0.8)


class Prompts:
    """Fresh random token prompts (never repeated unless asked)."""

    def __init__(self, seed: int = 0) -> None:
        self.rnd = random.Random(seed)

    def new(self, n: int) -> list[int]:
        return [self.rnd.randrange(4, 8000) for _ in range(n)]


def ttft(server: VllmServer, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    server.complete(prompt, max_tokens=1, timeout_s=900)
    return time.perf_counter() - t0


def measure_lengths(plain: VllmServer, kvc: VllmServer, lengths: list[int], reps: int,
                    gen: Prompts, bar: tqdm) -> list[dict[str, Any]]:
    rows = []
    for n in lengths:
        miss, engine, store, kvc_miss = [], [], [], []
        for _ in range(reps):
            p = gen.new(n)
            miss.append(ttft(plain, p))
            engine.append(ttft(plain, p))
            q = gen.new(n)
            kvc_miss.append(ttft(kvc, q))  # stores q
            kvc.reset_prefix_cache()
            store.append(ttft(kvc, q))
            bar.update(1)
        med = statistics.median
        rows.append({"prompt_len": n, "miss_ms": 1e3 * med(miss),
                     "engine_hit_ms": 1e3 * med(engine), "store_hit_ms": 1e3 * med(store),
                     "kvc_miss_ms": 1e3 * med(kvc_miss)})
    return rows


def measure_ratios(plain: VllmServer, kvc: VllmServer, n: int, reps: int, gen: Prompts,
                   bar: tqdm) -> list[dict[str, Any]]:
    rows = []
    for r in RATIOS:
        base, ours = [], []
        for _ in range(reps):
            base.append(ttft(plain, gen.new(n)))
            prefix = gen.new(int(r * n))
            if prefix:
                kvc.complete(prefix, max_tokens=1, timeout_s=900)  # store the prefix
                kvc.reset_prefix_cache()
            ours.append(ttft(kvc, prefix + gen.new(n - len(prefix))))
            bar.update(1)
        rows.append({"hit_ratio": r, "prompt_len": n,
                     "no_connector_ms": 1e3 * statistics.median(base),
                     "kvcentric_ms": 1e3 * statistics.median(ours)})
    return rows


def start_servers(model: str, store: dict[str, Any], max_len: int, threads_env: dict[str, str],
                  logs: Path) -> tuple[VllmServer, VllmServer]:
    common = {"model": model, "name": "bench", "dtype": "bfloat16", "max_model_len": max_len,
              "env": threads_env}
    plain = VllmServer(**common, log_path=logs / "plain.log")  # type: ignore[arg-type]
    kvc = VllmServer(**common, log_path=logs / "kvc.log",  # type: ignore[arg-type]
                     kv_transfer=connector_config(store))
    for s in (plain, kvc):
        s.start()
    for s in (plain, kvc):
        s.wait_ready(600)
    gen = Prompts(99)
    for s in (plain, kvc):  # warm-up: first requests pay one-off costs
        s.complete(gen.new(512), max_tokens=2, timeout_s=600)
    return plain, kvc


def summarize(lengths: list[dict[str, Any]], ratios: list[dict[str, Any]]) -> dict[str, Any]:
    top = lengths[-1]
    zero = ratios[0]
    return {
        "max_len": top["prompt_len"],
        "hit_over_miss_at_max_len": top["store_hit_ms"] / top["miss_ms"],
        "engine_hit_over_miss_at_max_len": top["engine_hit_ms"] / top["miss_ms"],
        "store_hit_over_engine_hit_at_max_len": top["store_hit_ms"] / top["engine_hit_ms"],
        "zero_hit_overhead": zero["kvcentric_ms"] / zero["no_connector_ms"] - 1,
        "ttft_by_hit_ratio": {f"{r['hit_ratio']:.1f}": r["kvcentric_ms"] / r["no_connector_ms"]
                              for r in ratios},
    }


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    ls = [r["prompt_len"] for r in res["lengths"]]
    for key, label in (("miss_ms", "miss (recompute)"), ("store_hit_ms", "kvcentric store hit"),
                       ("engine_hit_ms", "vLLM prefix-cache hit")):
        a1.plot(ls, [r[key] for r in res["lengths"]], marker="o", label=label)
    a1.set(xlabel="prompt tokens", ylabel="TTFT (ms)", yscale="log", title="TTFT by prompt length")
    a1.legend()
    rs = [100 * r["hit_ratio"] for r in res["ratios"]]
    a2.plot(rs, [r["no_connector_ms"] for r in res["ratios"]], marker="o", label="no connector")
    a2.plot(rs, [r["kvcentric_ms"] for r in res["ratios"]], marker="o", label="kvcentric")
    a2.set(xlabel="prefix hit ratio (%)", ylabel="TTFT (ms)",
           title=f"TTFT vs hit ratio, {res['ratios'][0]['prompt_len']} tokens")
    a2.legend()
    fig.suptitle(f"vLLM CPU, bench model, {res['worker_threads']} worker thread(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(res: dict[str, Any]) -> None:
    print(f"\nTTFT (ms, median of {res['reps']}), worker threads: {res['worker_threads']}")
    print(f"{'tokens':>7} {'miss':>9} {'store hit':>10} {'engine hit':>11} {'hit/miss':>9}")
    for r in res["lengths"]:
        print(f"{r['prompt_len']:>7} {r['miss_ms']:9.0f} {r['store_hit_ms']:10.0f} "
              f"{r['engine_hit_ms']:11.0f} {r['store_hit_ms'] / r['miss_ms']:9.3f}")
    print(f"\n{'hit ratio':>9} {'no conn':>9} {'kvcentric':>10} {'ratio':>7}")
    for r in res["ratios"]:
        print(f"{r['hit_ratio']:9.1f} {r['no_connector_ms']:9.0f} {r['kvcentric_ms']:10.0f} "
              f"{r['kvcentric_ms'] / r['no_connector_ms']:7.3f}")
    print("summary:", json.dumps(res["summary"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--reps", type=int)
    args = ap.parse_args()
    lengths = [1024, 2048] if args.quick else [1024, 2048, 4096, 8192]
    ratio_len = 2048 if args.quick else 4096
    reps = args.reps or (2 if args.quick else 3)
    reserved = "1" if (os.cpu_count() or 1) <= 2 else "0"
    threads_env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": reserved}
    model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    store = {"name": f"ttft-{uuid.uuid4().hex[:6]}", "capacity": "3gb"}
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    plain, kvc = start_servers(model, store, max(lengths) + 512, threads_env, logs)
    try:
        gen = Prompts(1)
        with tqdm(total=reps * (len(lengths) + len(RATIOS)), desc="ttft") as bar:
            rows = measure_lengths(plain, kvc, lengths, reps, gen, bar)
            ratios = measure_ratios(plain, kvc, ratio_len, reps, gen, bar)
    finally:
        plain.stop()
        kvc.stop()
        launcher.stop(StoreConfig.from_dict(store))
    res = {"benchmark": "ttft", "quick": args.quick, "reps": reps, "model": "bench (bf16)",
           "worker_threads": f"cores - {reserved} reserved", "lengths": rows, "ratios": ratios,
           "summary": summarize(rows, ratios)}
    print_table(res)
    out = args.out or RESULTS / f"ttft{'_quick' if args.quick else ''}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
