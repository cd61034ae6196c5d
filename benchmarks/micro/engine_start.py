"""How long does a vLLM CPU engine take to start, by how the test suite starts it?

    python -m benchmarks.micro.engine_start [--reps 3] [--tp 1|2] [--out FILE.json]

One tiny random-weight engine (:mod:`kvcentric.testing.models`), alone, from the call that
starts it until ``/health`` answers, and until its first answer, several ways, the arms
alternating in each repetition:

- ``default``: vLLM's CPU defaults (API server, EngineCore and a worker process, each
  importing vLLM: the CPU platform forces ``spawn``);
- ``uni``: the worker in the EngineCore (``KVC_ENGINE_EXECUTOR=uni``: what the test
  session sets for one-rank engines; one rank only);
- ``zygote``: as the session starts it until 3383b00: ``uni``, forked from a process that
  imported vLLM's API server once (:mod:`kvcentric.testing.zygote`, started before the
  timed part, as a session does); vLLM spawns the EngineCore (and TP workers);
- ``forked``: the zygote with :data:`~kvcentric.testing.zygote.FORKING_VLLM_ENTRY`: the
  EngineCore and TP workers forked too (:mod:`kvcentric.testing.vllm_forking`);
- ``session``: ``forked`` with torch.compile off (``TORCHDYNAMO_DISABLE=1``): what the
  test session runs since 3383b00 (tests/helpers/hermetic.py); at TP > 1 vLLM compiles
  the vocab-parallel embedding's mask on the first request unless compile is off.

Each start answers one greedy request, whose tokens must be the same in every arm.
Output: median and spread per arm of both times, and each arm's medians over
``default``'s.
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
from kvcentric.testing.zygote import FORKING_VLLM_ENTRY, Zygote

ARMS = ("default", "uni", "zygote", "forked", "session")
PROMPT = list(range(1, 200))


def arms_for(tp: int) -> tuple[str, ...]:
    """The arms at tensor-parallel size ``tp`` (``uni`` is one rank's)."""
    return ARMS if tp == 1 else tuple(a for a in ARMS if a != "uni")


def start_once(model: str, arm: str, logs: Path, zygotes: dict[str, Zygote],
               tp: int = 1) -> tuple[float, float, list[int]]:
    """Seconds from start to ready and to the first answer for one engine of ``arm``, and
    its greedy tokens."""
    env = {} if arm == "default" else {EXECUTOR_ENV: "uni"}
    if arm == "session":
        env["TORCHDYNAMO_DISABLE"] = "1"
    args: tuple[str, ...] = ()
    if tp > 1:
        args = ("--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp")
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    VllmServer.zygote = zygotes.get("forked" if arm == "session" else arm)
    try:
        srv = VllmServer(model, env=env, args=args,
                         log_path=logs / f"{arm}-{time.monotonic_ns()}.log")
        t0 = time.monotonic()
        try:
            srv.start().wait_ready()
            ready = time.monotonic() - t0
            toks = srv.tokens(PROMPT, 16)
            return ready, time.monotonic() - t0, toks
        finally:
            srv.stop()
    finally:
        VllmServer.zygote = None


def run(reps: int, tp: int = 1) -> dict[str, Any]:
    model = str(build_model("tiny", Path.cwd() / ".models" / "tiny"))
    arms = arms_for(tp)
    ready: dict[str, list[float]] = {a: [] for a in arms}
    first: dict[str, list[float]] = {a: [] for a in arms}
    tokens: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="kvc-engine-start-") as tmp:
        logs = Path(tmp)
        zygotes = {"zygote": Zygote(logs / "z" / "zygote.sock", logs / "zygote.log"),
                   "forked": Zygote(logs / "f" / "zygote.sock", logs / "forked.log",
                                    entry=FORKING_VLLM_ENTRY)}
        try:
            # the zygotes start here, before the timed part, as with a session's first engine
            for arm in zygotes:
                start_once(model, arm, logs, zygotes, tp)
            for rep in range(reps):
                order = arms if rep % 2 == 0 else tuple(reversed(arms))
                for arm in order:
                    r, f, toks = start_once(model, arm, logs, zygotes, tp)
                    ready[arm].append(r)
                    first[arm].append(f)
                    if tokens.setdefault(arm, toks) != toks:
                        raise RuntimeError(f"{arm}: the tokens changed between starts")
                    print(f"rep {rep} {arm}: ready in {r:.1f} s, first answer {f:.1f} s",
                          flush=True)
        finally:
            for z in zygotes.values():
                z.close()

    def summary(t: list[float], base: list[float]) -> dict[str, Any]:
        return {"s": t, "median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                "over_default": statistics.median(t) / statistics.median(base)}

    return {"benchmark": "engine_start", "reps": reps, "model": "tiny", "tp": tp,
            "arms": {a: {"ready": summary(ready[a], ready["default"]),
                         "first_answer": summary(first[a], first["default"])}
                     for a in arms},
            "tokens_identical": len({tuple(t) for t in tokens.values()}) == 1}


def table(res: dict[str, Any]) -> str:
    rows = ["| arm | ready median s | min-max s | over default | first answer median s | "
            "min-max s | over default |", "|---|---:|---:|---:|---:|---:|---:|"]
    for arm, r in res["arms"].items():
        cells = [f"{x['median_s']:.1f} | {x['min_s']:.1f}-{x['max_s']:.1f} | "
                 f"{x['over_default']:.2f}" for x in (r["ready"], r["first_answer"])]
        rows.append(f"| {arm} | {cells[0]} | {cells[1]} |")
    return (f"TP {res['tp']}\n\n" + "\n".join(rows)
            + f"\n\ntokens identical: {res['tokens_identical']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tp", type=int, choices=(1, 2), default=1)
    ap.add_argument("--out", type=Path, default=None,
                    help="default: results/engine_start.json (engine_start_tp2.json at TP 2)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = RESULTS / ("engine_start.json" if args.tp == 1 else "engine_start_tp2.json")
    res = run(args.reps, args.tp)
    rw.write(args.out, res, table=table(res), command=rw.command_line(__file__, argv))


if __name__ == "__main__":
    main()
