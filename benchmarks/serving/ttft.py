"""How much faster is a store hit than a recompute, and how close to the engine's own hit?

TTFT: recompute vs store hit vs the engine's own prefix-cache hit, and TTFT vs hit ratio.

    python -m benchmarks.serving.ttft [--quick] [--lengths 1024,4096,8192] [--no-lmcache]
                                    [--out FILE.json]
    python -m benchmarks.serving.ttft --writer [--runs 3] [--lengths 1024,4096]

Two vLLM CPU servers with the ``bench`` model, started in this run, both pinned to the
same worker thread count (``VLLM_CPU_NUM_OF_RESERVED_CPU``; on 2 cores vLLM otherwise
gives a connector-enabled worker 2 threads and a plain one 1):

- ``plain``: no connector. Miss = a never-seen prompt; engine hit = the same prompt again.
- ``kvc``: kvcentric connector on a local store. Store hit = a prompt this server stored,
  after ``/reset_prefix_cache`` (so only the store can supply it: the server is as fresh
  as a new instance for that prompt). An exact repeat loads every full block and the
  prompt's tail: vLLM computes one token. Hit-ratio sweep: a prefix of r x L tokens is
  stored, then a prompt of L tokens starting with it is timed.
- ``lmcache`` (when ``.peers/lmcache`` exists: ``python -m benchmarks.serving.lmcache_peer setup``):
  LMCache 0.5.6's ``LMCacheMPConnector`` against an ``lmcache server``, same vLLM, same
  torch, same thread pinning, measured like ``kvc`` (its hit also loads the partial last
  chunk). ``tokens_identical`` says whether every arm's hit produced the token its own
  miss produced.

TTFT is the latency of a ``max_tokens=1`` completion (prefill + first token), median of
``--reps`` fresh prompts. Everything is compared in ratios within this run.

``--writer``: what saving costs a miss (0% hit), on the *first* saving request of a fresh
instance and in steady state (``--reps`` more prompts, default 3), over ``--runs`` fresh
rounds; every prompt goes to every arm back to back and the overhead is the median of the
paired ratios to ``plain`` (:mod:`benchmarks.serving.ttft_writer`). Writes ``ttft_writer.json``
and its PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.lib import results_writer
from benchmarks.lib.paths import RESULTS
from benchmarks.lib.procfs import quiesce
from benchmarks.serving import lmcache_peer, ttft_writer, work
from benchmarks.serving.lmcache_peer import LMCacheServer
from kvcentric.config import StoreConfig
from kvcentric.store.local import launcher
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import VllmServer, connector_config

RATIOS = (0.0, 0.2, 0.4, 0.6, 0.8)
BLOCK_TOKENS = 128  # the connector's block on vLLM CPU (its page), for work in tokens
WRITER_BARS = {1024: 0.05, 4096: 0.02}  # issue 20: the most a 0%-hit save may add to TTFT


class Prompts:
    """Fresh random token prompts (never repeated unless asked)."""

    def __init__(self, seed: int = 0) -> None:
        self.rnd = random.Random(seed)

    def new(self, n: int) -> list[int]:
        return [self.rnd.randrange(4, 8000) for _ in range(n)]


class Clock:
    """Times ``max_tokens=1`` completions, each once every arm's processes are quiet.

    A vLLM CPU worker keeps its core busy for about a second after each request (it
    polls for the next step), and every arm's worker is pinned to the same cores: a
    request sent right after another arm's would be timed against that polling (measured
    here: a 1k-token miss at 1.8 s instead of 1.2 s). :func:`benchmarks.lib.procfs.quiesce`
    waits it out before each timed request; ``waited_s`` keeps the waits."""

    def __init__(self, pgids: list[int]) -> None:
        self.pgids = pgids
        self.waited_s: list[float] = []

    @classmethod
    def of(cls, servers: dict[str, VllmServer], lmc: LMCacheServer | None) -> Clock:
        procs = [s.proc for s in servers.values()] + [lmc.proc if lmc else None]
        return cls([p.pid for p in procs if p is not None])  # each leads its own group

    def ttft(self, server: VllmServer, prompt: list[int]) -> tuple[float, list[int]]:
        """Seconds to the first (only) token, and the token."""
        self.waited_s.append(quiesce(self.pgids))
        t0 = time.perf_counter()
        out = server.complete(prompt, max_tokens=1, timeout_s=900)
        return time.perf_counter() - t0, list(out["choices"][0]["token_ids"])


def measure_lengths(clock: Clock, plain: VllmServer, arms: dict[str, VllmServer],
                    lengths: list[int], reps: int, gen: Prompts, bar: tqdm,
                    readers: dict[str, Callable[[], work.Work]]) -> list[dict[str, Any]]:
    """Per length: miss and engine hit on ``plain``; per connector arm, its miss (which
    stores the prompt) and its store hit after the engine's cache is reset. Each arm's
    own counters (``readers``) must show it saved and loaded at that length, else the
    row names it in ``<arm>_invalid`` and its hit is no hit."""
    rows = []
    for n in lengths:
        got: dict[str, list[float]] = {"miss": [], "engine_hit": []}
        before = {name: read() for name, read in readers.items()}
        same = True
        for _ in range(reps):
            p = gen.new(n)
            got["miss"].append(clock.ttft(plain, p)[0])
            got["engine_hit"].append(clock.ttft(plain, p)[0])
            q = gen.new(n)
            for name, srv in arms.items():
                t_miss, tok_miss = clock.ttft(srv, q)
                srv.reset_prefix_cache()
                t_hit, tok_hit = clock.ttft(srv, q)
                got.setdefault(f"{name}_miss", []).append(t_miss)
                got.setdefault(f"{name}_hit", []).append(t_hit)
                same &= tok_hit == tok_miss
            bar.update(1)
        row: dict[str, Any] = {"prompt_len": n, "tokens_identical": same}
        row |= {f"{k}_ms": 1e3 * statistics.median(v) for k, v in got.items()}
        for name, read in readers.items():
            done = read() - before[name]
            row[f"{name}_work"] = done.as_dict()
            why = work.invalid(done, saves=True, loads=True)
            if why is not None:
                row[f"{name}_invalid"] = why
        row["store_hit_ms"] = row["kvc_hit_ms"]  # the name earlier results use
        rows.append(row)
    return rows


def measure_ratios(clock: Clock, plain: VllmServer, kvc: VllmServer, n: int, reps: int,
                   gen: Prompts, bar: tqdm) -> list[dict[str, Any]]:
    rows = []
    for r in RATIOS:
        base, ours = [], []
        for _ in range(reps):
            base.append(clock.ttft(plain, gen.new(n))[0])
            prefix = gen.new(int(r * n))
            if prefix:
                kvc.complete(prefix, max_tokens=1, timeout_s=900)  # store the prefix
                kvc.reset_prefix_cache()
            ours.append(clock.ttft(kvc, prefix + gen.new(n - len(prefix)))[0])
            bar.update(1)
        rows.append({"hit_ratio": r, "prompt_len": n,
                     "no_connector_ms": 1e3 * statistics.median(base),
                     "kvcentric_ms": 1e3 * statistics.median(ours)})
    return rows


def work_readers(servers: dict[str, VllmServer], lmc: LMCacheServer | None
                 ) -> dict[str, Callable[[], work.Work]]:
    """Each connector arm's own count of what it saved and loaded (:mod:`.work`): ours
    from our connector's counters on its vLLM, LMCache's from its server's."""
    out: dict[str, Callable[[], work.Work]] = {}
    if "kvc" in servers:
        kvc = servers["kvc"]
        out["kvc"] = lambda: work.ours(kvc.metrics(), BLOCK_TOKENS)
    if "lmcache" in servers and lmc is not None:
        out["lmcache"] = lmc.work_done
    return out


def start_servers(model: str, store: dict[str, Any], max_len: int, threads_env: dict[str, str],
                  logs: Path, lmc: LMCacheServer | None,
                  warm_tokens: int = 512) -> dict[str, VllmServer]:
    """Every arm's server, started and warmed up with one ``warm_tokens`` request (512:
    one-off costs of saving paid too; 32: less than a block, nothing saved)."""
    common = {"model": model, "name": "bench", "dtype": "bfloat16", "max_model_len": max_len,
              "env": threads_env}
    servers = {
        "plain": VllmServer(**common, log_path=logs / "plain.log"),  # type: ignore[arg-type]
        "kvc": VllmServer(**common, log_path=logs / "kvc.log",  # type: ignore[arg-type]
                          kv_transfer=connector_config(store)),
    }
    if lmc is not None:
        exe = lmcache_peer.python()
        assert exe is not None
        servers["lmcache"] = VllmServer(
            **{**common, "env": {**threads_env, **lmcache_peer.ENV}},  # type: ignore[arg-type]
            log_path=logs / "lmcache.log", kv_transfer=lmc.transfer_config(),
            python=str(exe))
    for s in servers.values():
        s.start()
    for s in servers.values():
        s.wait_ready(600)
    gen = Prompts(99)
    for s in servers.values():  # warm-up: first requests pay one-off costs
        s.complete(gen.new(warm_tokens), max_tokens=1 if warm_tokens < 128 else 2,
                   timeout_s=600)
    return servers


def writer_round(model: str, store: dict[str, Any], n: int, reps: int, threads_env: dict[str, str],
                 logs: Path, lmc: LMCacheServer | None, gen: Prompts, turn: int,
                 bar: tqdm) -> ttft_writer.RoundTimes:
    """Fresh servers; every arm's first saving request of ``n`` tokens, then ``reps`` more
    (:func:`benchmarks.serving.ttft_writer.time_round`)."""
    servers = start_servers(model, store, n + 512, threads_env, logs, lmc, warm_tokens=32)
    try:
        prompts = [gen.new(n) for _ in range(reps + 1)]
        clock = Clock.of(servers, lmc)
        got = ttft_writer.time_round(servers, prompts, turn, lambda s, p: clock.ttft(s, p)[0],
                                     work_readers(servers, lmc), bar)
        got.quiesce_s = clock.waited_s
        return got
    finally:
        for srv in servers.values():
            srv.stop()


def measure_writer(model: str, store: dict[str, Any], lengths: list[int], runs: int, reps: int,
                   threads_env: dict[str, str], logs: Path,
                   lmc: LMCacheServer | None) -> list[dict[str, Any]]:
    gen = Prompts(7)
    rows = []
    arms = 3 if lmc is not None else 2
    with tqdm(total=runs * len(lengths) * arms * (reps + 1), desc="writer") as bar:
        for n in lengths:
            rounds = [writer_round(model, store, n, reps, threads_env, logs, lmc, gen, turn, bar)
                      for turn in range(runs)]
            rows.append(ttft_writer.overheads(rounds, n))
    return rows


def summarize(lengths: list[dict[str, Any]], ratios: list[dict[str, Any]]) -> dict[str, Any]:
    top = lengths[-1]
    zero = ratios[0]
    return {
        "max_len": top["prompt_len"],
        "hit_over_miss_at_max_len": top["store_hit_ms"] / top["miss_ms"],
        "engine_hit_over_miss_at_max_len": top["engine_hit_ms"] / top["miss_ms"],
        "store_hit_over_engine_hit_at_max_len": top["store_hit_ms"] / top["engine_hit_ms"],
        "tokens_identical": all(r["tokens_identical"] for r in lengths),
        **({"store_hit_over_lmcache_hit_at_max_len": top["kvc_hit_ms"] / top["lmcache_hit_ms"]}
           if "lmcache_hit_ms" in top and "lmcache_invalid" not in top else {}),
        "invalid_arms": sorted({k[:-len("_invalid")] for r in lengths for k in r
                                if k.endswith("_invalid")}),
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
                       ("lmcache_hit_ms", "LMCache hit"),
                       ("engine_hit_ms", "vLLM prefix-cache hit")):
        if key in res["lengths"][0]:
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
    lmc = "lmcache_hit_ms" in res["lengths"][0]
    print(f"{'tokens':>7} {'miss':>9} {'store hit':>10} " + (f"{'LMCache hit':>12} " if lmc
          else "") + f"{'engine hit':>11} {'hit/miss':>9} {'hit/engine':>11} {'same':>5}")
    for r in res["lengths"]:
        print(f"{r['prompt_len']:>7} {r['miss_ms']:9.0f} {r['store_hit_ms']:10.0f} "
              + (f"{r['lmcache_hit_ms']:12.0f} " if lmc else "")
              + f"{r['engine_hit_ms']:11.0f} {r['store_hit_ms'] / r['miss_ms']:9.3f} "
              f"{r['store_hit_ms'] / r['engine_hit_ms']:11.3f} {str(r['tokens_identical']):>5}")
    print(f"\n{'hit ratio':>9} {'no conn':>9} {'kvcentric':>10} {'ratio':>7}")
    for r in res["ratios"]:
        print(f"{r['hit_ratio']:9.1f} {r['no_connector_ms']:9.0f} {r['kvcentric_ms']:10.0f} "
              f"{r['kvcentric_ms'] / r['no_connector_ms']:7.3f}")
    for r in res["lengths"]:
        for k, why in r.items():
            if k.endswith("_invalid"):
                print(f"INVALID at {r['prompt_len']} tokens: {k[:-len('_invalid')]} {why}; "
                      "its hit column is a recompute, not a hit")
    print("summary:", json.dumps(res["summary"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--lengths", type=lambda v: [int(x) for x in v.split(",")])
    ap.add_argument("--no-lmcache", action="store_true",
                    help="skip the LMCache arm even when its venv exists")
    ap.add_argument("--writer", action="store_true",
                    help="measure the writer's overhead on fresh instances (see above)")
    ap.add_argument("--runs", type=int, default=3, help="fresh-server rounds for --writer")
    args = ap.parse_args()
    if args.writer:
        return writer_main(args)
    lengths = args.lengths or ([1024, 2048] if args.quick else [1024, 2048, 4096, 8192])
    ratio_len = 2048 if args.quick else 4096
    reps = args.reps or (2 if args.quick else 3)
    reserved, threads_env, model, store, logs, lmc = setup(args, "ttft")
    servers: dict[str, VllmServer] = {}
    try:
        servers = start_servers(model, store, max(lengths) + 512, threads_env, logs, lmc)
        plain, kvc = servers["plain"], servers["kvc"]
        arms = {k: v for k, v in servers.items() if k != "plain"}
        gen = Prompts(1)
        with tqdm(total=reps * (len(lengths) + len(RATIOS)), desc="ttft") as bar:
            clock = Clock.of(servers, lmc)
            rows = measure_lengths(clock, plain, arms, lengths, reps, gen, bar,
                                   work_readers(servers, lmc))
            ratios = measure_ratios(clock, plain, kvc, ratio_len, reps, gen, bar)
    finally:
        for srv in servers.values():
            srv.stop()
        if lmc is not None:
            lmc.stop()
        launcher.stop(StoreConfig.from_dict(store))
    res = {"benchmark": "ttft", "quick": args.quick, "reps": reps, "model": "bench (bf16)",
           "worker_threads": f"cores - {reserved} reserved", "lengths": rows, "ratios": ratios,
           "summary": summarize(rows, ratios)}
    print_table(res)
    out = args.out or RESULTS / f"ttft{'_quick' if args.quick else ''}.json"
    results_writer.write(out, res, command=results_writer.command_line(__file__))
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.png')}")


def setup(args: argparse.Namespace, name: str) -> tuple[str, dict[str, str], str,
                                                       dict[str, Any], Path,
                                                       LMCacheServer | None]:
    """What every mode needs: the reserved-CPU count and env (the same worker threads in
    every arm), the model, a fresh store name, the log dir and (if set up) LMCache's
    server, started."""
    reserved = "1" if (os.cpu_count() or 1) <= 2 else "0"
    threads_env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": reserved}
    model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    store = {"name": f"{name}-{uuid.uuid4().hex[:6]}", "capacity": "3gb"}
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    lmc = None
    if not args.no_lmcache and lmcache_peer.python() is not None:
        lmc = LMCacheServer(size_gb=3, log_path=logs / "lmcache-server.log").start()
    return reserved, threads_env, model, store, logs, lmc


def writer_main(args: argparse.Namespace) -> None:
    lengths = args.lengths or [1024, 4096]
    reps = args.reps or 3
    reserved, threads_env, model, store, logs, lmc = setup(args, "ttftw")
    try:
        rows = measure_writer(model, store, lengths, args.runs, reps, threads_env, logs, lmc)
    finally:
        if lmc is not None:
            lmc.stop()
        launcher.stop(StoreConfig.from_dict(store))
    summary = {f"{k}_{r['prompt_len']}": v for r in rows for k, v in r.items()
               if k.endswith("_overhead")}
    res = {"benchmark": "ttft_writer", "runs": args.runs, "steady_reps": reps,
           "model": "bench (bf16)", "worker_threads": f"cores - {reserved} reserved",
           "rows": rows, "summary": summary}
    text = (f"writer overhead at 0% hit: median over {args.runs} fresh rounds of the paired "
            f"ratio to no connector [quartiles]; {reps} steady prompts per round\n"
            + ttft_writer.table(rows))
    out = args.out or RESULTS / "ttft_writer.json"
    fig = results_writer.Figure("overhead", "Writer overhead at 0% hit, per fresh round",
                                lambda p: ttft_writer.plot(rows, p, WRITER_BARS))
    results_writer.write(out, res, text, [fig], results_writer.command_line(__file__))


if __name__ == "__main__":
    main()
