"""How long does a vLLM CPU engine take to start, by how the test suite starts it?

    python -m benchmarks.micro.engine_start [--reps 3] [--out FILE.json]

One tiny random-weight engine (:mod:`kvcentric.testing.models`), alone, from the call that
starts it until ``/health`` answers, three ways, the arms alternating in each repetition:

- ``default``: vLLM's CPU defaults (API server, EngineCore and a worker process, each
  importing vLLM: the CPU platform forces ``spawn``);
- ``uni``: the worker in the EngineCore (``KVC_ENGINE_EXECUTOR=uni``: what the test
  session sets for one-rank engines);
- ``zygote``: ``uni``, forked from a process that imported vLLM's API server once
  (:mod:`kvcentric.testing.zygote`, started before the timed part, as a session does).

Each start answers one greedy request, whose tokens must be the same in every arm.
Output: median and spread per arm, and each arm's median over ``default``'s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import EXECUTOR_ENV, VllmServer
from kvcentric.testing.zygote import Zygote

ARMS = ("default", "uni", "zygote")
PROMPT = list(range(1, 200))


def start_once(model: str, arm: str, logs: Path, zygote: Zygote) -> tuple[float, list[int]]:
    """Seconds from start to ready for one engine of ``arm``, and its greedy tokens."""
    env = {} if arm == "default" else {EXECUTOR_ENV: "uni"}
    VllmServer.zygote = zygote if arm == "zygote" else None
    try:
        srv = VllmServer(model, env=env, log_path=logs / f"{arm}-{time.monotonic_ns()}.log")
        t0 = time.monotonic()
        try:
            srv.start().wait_ready()
            ready = time.monotonic() - t0
            return ready, srv.tokens(PROMPT, 16)
        finally:
            srv.stop()
    finally:
        VllmServer.zygote = None


def run(reps: int) -> dict[str, Any]:
    model = str(build_model("tiny", Path.cwd() / ".models" / "tiny"))
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    tokens: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="kvc-engine-start-") as tmp:
        logs = Path(tmp)
        zygote = Zygote(logs / "z" / "zygote.sock", logs / "zygote.log")
        try:
            # the zygote starts here, before the timed part, as with a session's first engine
            start_once(model, "zygote", logs, zygote)
            for rep in range(reps):
                order = ARMS if rep % 2 == 0 else tuple(reversed(ARMS))
                for arm in order:
                    s, toks = start_once(model, arm, logs, zygote)
                    times[arm].append(s)
                    if tokens.setdefault(arm, toks) != toks:
                        raise RuntimeError(f"{arm}: the tokens changed between starts")
                    print(f"rep {rep} {arm}: ready in {s:.1f} s", flush=True)
        finally:
            zygote.close()
    base = statistics.median(times["default"])
    return {"benchmark": "engine_start", "reps": reps, "model": "tiny",
            "arms": {a: {"ready_s": t, "median_s": statistics.median(t),
                         "min_s": min(t), "max_s": max(t),
                         "over_default": statistics.median(t) / base}
                     for a, t in times.items()},
            "tokens_identical": len({tuple(t) for t in tokens.values()}) == 1}


def table(res: dict[str, Any]) -> str:
    rows = ["| arm | median s | min-max s | over default |", "|---|---:|---:|---:|"]
    for arm, r in res["arms"].items():
        rows.append(f"| {arm} | {r['median_s']:.1f} | {r['min_s']:.1f}-{r['max_s']:.1f} | "
                    f"{r['over_default']:.2f} |")
    return "\n".join(rows) + f"\n\ntokens identical: {res['tokens_identical']}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "engine_start.json")
    args = ap.parse_args(argv)
    res = run(args.reps)
    rw.write(args.out, res, table=table(res), command=rw.command_line(__file__, argv))


if __name__ == "__main__":
    main()
