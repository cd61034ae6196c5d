"""Does serving survive a process killed under load: failed requests, wrong tokens, recovery?

Kill matrix under load: faults injected for real while a multi-turn workload runs; the
``-stop`` faults (a SIGSTOPped store process mid-load: the TTFT of requests in flight
against a miss's) are :mod:`benchmarks.reliability.stops`.

    python -m benchmarks.reliability.faults [--backends local,mooncake] [--faults engine,...]
                                            [--quick] [--out FILE.json]

Per backend, one stack (:mod:`benchmarks.reliability.stack`: store, two vLLM CPU engines with
the connector, the kvcentric router; ``tiny`` model in float32, so greedy tokens are the
same whether KV is recomputed or reused). ``--users`` conversations run concurrently
through the router, each ``--turns`` turns (a shared system prompt, the user's document,
then a new message per turn; non-streamed greedy completions). A fault-free run gives
the reference answers; every later prompt is built from the reference answers, so each
request of a fault run has a known right answer. Each fault then gets a fresh stack and
the same workload, and is injected (SIGKILL, then a supervisor's restart where one would
restart it) once half the requests are done.

The suite (``tests/e2e/test_faults.py``) runs a reduced matrix the cheap way: one stack per
backend for all of that backend's rows (the ``-stop`` rows first, then the kills, the engine
kill last: that engine stays dead), each kill row on prompts of its own
(``Workload.seed``), its reference from a plain engine (:func:`reference`), and
:func:`kill_row` per fault. Its rows: local ``coordinator-stop``, ``coordinator``,
``engine``; Mooncake ``master-stop``, ``node-stop``, ``master``. Only this command runs the
local ``router`` kill and the Mooncake ``node`` and ``engine`` kills, and only here is each
kill independent of the others (a fresh stack, a fault-free reference run through the same
kind of stack): ``--quick`` is the suite's workload over the full matrix.

Clients retry a refused connection (nothing sent; a restarting router) for up to a minute,
as any HTTP client would; nothing else is retried. Per fault: ``failed`` requests (HTTP
error or no answer), ``wrong_tokens`` (answers that differ from the reference),
``hits_before``/``hits_after`` (mean fraction of a later-turn prompt served from cache --
engine or store -- before and after the fault, from vLLM's
``usage.prompt_tokens_details.cached_tokens``) and ``recovery_s`` (from the fault to the
first later-turn request served at least half from cache; ``null``: never). Targets: zero
wrong tokens everywhere; zero failed requests except for the router's own death; for the
``-stop`` rows, in-flight TTFT at most a miss's + 0.5 s (``over_miss_s``).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS
from benchmarks.reliability.stack import FAULTS, Stack
from benchmarks.reliability.stops import STOPS, StopWorkload, run_stop
from benchmarks.reliability.stops import table as stop_table
from kvcentric.testing.models import build_model
from kvcentric.testing.netns import NetNamespace

CONNECT_RETRY_S = 60.0
SEED_STRIDE = 1_000_000  # past every per-user and per-turn offset of Workload's generators


@dataclass(frozen=True)
class Workload:
    users: int = 4
    turns: int = 6
    system_len: int = 384
    doc_len: int = 256
    msg_len: int = 96
    answer_len: int = 8
    # other prompts, same shape: rows that share a stack (the suite's) each get their own
    seed: int = 0

    def opening(self, user: int) -> list[int]:
        rnd = random.Random(1 + SEED_STRIDE * self.seed)
        system = [rnd.randrange(4, 4000) for _ in range(self.system_len)]
        rnd = random.Random(100 + user + SEED_STRIDE * self.seed)
        return system + [rnd.randrange(4, 4000) for _ in range(self.doc_len)]

    def message(self, user: int, turn: int) -> list[int]:
        rnd = random.Random(10_000 + 100 * user + turn + SEED_STRIDE * self.seed)
        return [rnd.randrange(4, 4000) for _ in range(self.msg_len)]


@dataclass
class Outcome:
    user: int
    turn: int
    t0: float
    t1: float
    tokens: list[int] | None = None
    prompt_len: int = 0
    cached: int = 0
    error: str = ""


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    fault_at: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


def request(url: str, prompt: list[int], max_tokens: int,
            connect_for_s: float = CONNECT_RETRY_S) -> tuple[list[int], int]:
    """One greedy completion. A refused connection (nothing was sent: the router is
    restarting) is retried for ``connect_for_s``, as any HTTP client or load balancer
    would; every other failure is the request's."""
    deadline = time.monotonic() + connect_for_s
    while True:
        try:
            r = httpx.post(url + "/v1/completions", timeout=180, json={
                "model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
            break
        except httpx.ConnectError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)
    r.raise_for_status()
    body = r.json()
    details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
    return list(body["choices"][0]["token_ids"]), int(details.get("cached_tokens") or 0)


def user_loop(stack: Stack, w: Workload, user: int, ref: dict[tuple[int, int], list[int]] | None,
              run: Run, bar: tqdm) -> None:
    """One conversation; later prompts use the reference answers (or, in the reference
    run, its own)."""
    history = w.opening(user)
    ctx = stack.ns.entered() if stack.ns is not None else contextlib.nullcontext()
    with ctx:
        for t in range(w.turns):
            history = history + w.message(user, t)
            out = Outcome(user, t, time.monotonic(), 0.0, prompt_len=len(history))
            try:
                out.tokens, out.cached = request(stack.url, history, w.answer_len)
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                out.error = f"{type(exc).__name__}: {exc}"[:200]
            out.t1 = time.monotonic()
            with run.lock:
                run.outcomes.append(out)
            bar.update()
            answer = ref[(user, t)] if ref is not None else out.tokens
            if answer is None:
                raise RuntimeError(f"the reference run failed: {out.error}")
            history = history + answer


def drive(stack: Stack, w: Workload, ref: dict[tuple[int, int], list[int]] | None,
          fault: str | None, bar: tqdm) -> Run:
    run = Run()
    threads = [threading.Thread(target=user_loop, args=(stack, w, u, ref, run, bar))
               for u in range(w.users)]
    for th in threads:
        th.start()
    if fault is not None:
        half = w.users * w.turns // 2
        while len(run.outcomes) < half and any(th.is_alive() for th in threads):
            time.sleep(0.05)
        run.fault_at = time.monotonic()
        ctx = stack.ns.entered() if stack.ns is not None else contextlib.nullcontext()
        with ctx:
            stack.inject(fault)
    for th in threads:
        th.join()
    return run


def reference(url: str, w: Workload) -> dict[tuple[int, int], list[int]]:
    """``w``'s fault-free answers from one engine (or router) at ``url``: each user's turns
    in order, one request at a time, every later prompt built from the earlier answers.
    Greedy float32 tokens are the same from a plain engine as from a stack's, so a plain
    engine serves as the reference of a stack's run (the suite's shared one does)."""
    ref: dict[tuple[int, int], list[int]] = {}
    for user in range(w.users):
        history = w.opening(user)
        for t in range(w.turns):
            history = history + w.message(user, t)
            ref[(user, t)], _ = request(url, history, w.answer_len)
            history = history + ref[(user, t)]
    return ref


def kill_row(stack: Stack, fault: str, w: Workload,
             ref: dict[tuple[int, int], list[int]]) -> dict[str, Any]:
    """One kill row on a started ``stack``: ``w`` through its router, ``fault`` injected at
    half load, scored against ``ref`` (from :func:`reference`, or a fault-free run)."""
    with tqdm(total=w.users * w.turns, desc=fault, disable=True) as bar:
        run = drive(stack, w, ref, fault, bar)
    return score(run, ref, fault, stack.backend)


def score(run: Run, ref: dict[tuple[int, int], list[int]], fault: str,
          backend: str) -> dict[str, Any]:
    failed = [o for o in run.outcomes if o.tokens is None]
    wrong = [o for o in run.outcomes if o.tokens is not None and o.tokens != ref[(o.user, o.turn)]]
    later = [o for o in run.outcomes if o.turn > 0 and o.tokens is not None]
    t = run.fault_at or 0.0
    before = [o.cached / o.prompt_len for o in later if o.t1 <= t]
    after = [o for o in later if o.t0 >= t]
    back = [o.t1 - t for o in sorted(after, key=lambda o: o.t1) if o.cached >= o.prompt_len / 2]
    return {"fault": fault, "backend": backend, "requests": len(run.outcomes),
            "failed": len(failed), "wrong_tokens": len(wrong),
            "recovery_s": round(back[0], 2) if back else None,
            "hits_before": round(statistics.mean(before), 3) if before else None,
            "hits_after": round(statistics.mean(o.cached / o.prompt_len for o in after), 3)
            if after else None,
            "errors": sorted({o.error for o in failed})[:3]}


@contextlib.contextmanager
def stack_for(backend: str, model: str, logs: Path, ns: NetNamespace | None) -> Iterator[Stack]:
    stack = Stack(backend, model, logs, ns)

    def inside() -> contextlib.AbstractContextManager[None]:
        return ns.entered() if ns is not None else contextlib.nullcontext()

    try:
        with inside():
            stack.start()
        yield stack
    finally:
        with inside():
            stack.stop()


def plan_of(backends: list[str], faults: list[str] | None) -> list[tuple[str, str]]:
    """(backend, fault) pairs: every fault a backend has, or those named."""
    return [(b, f) for b in backends for f in FAULTS[b] if faults is None or f in faults]


def matrix(plan: list[tuple[str, str]], w: Workload, logs: Path,
           stop_w: StopWorkload | None = None) -> list[dict[str, Any]]:
    """One row per (backend, fault); the reference comes from one fault-free run (float32:
    the same answers on either backend). ``-stop`` faults run ``stop_w`` instead, their
    reference from the stack's writer engine; consecutive ones on one backend share a
    stack (a stop kills nothing, each round stores prompts of its own, and the row holds
    only once hits came back after SIGCONT), a kill gets a fresh one."""
    model = str(build_model("tiny", Path.cwd() / ".models" / "tiny"))
    rows: list[dict[str, Any]] = []
    need_ns = any(b == "mooncake" for b, _ in plan)
    with (NetNamespace() if need_ns else contextlib.nullcontext()) as ns, \
            tqdm(total=(sum(f not in STOPS for _, f in plan) + 1) * w.users * w.turns,
                 desc="requests") as bar:
        ref_run: Run | None = None
        i = 0
        while i < len(plan):
            backend, fault = plan[i]
            space = ns if backend == "mooncake" else None
            if fault in STOPS:
                j = i
                while j < len(plan) and plan[j][0] == backend and plan[j][1] in STOPS:
                    j += 1
                with stack_for(backend, model, logs, space) as stack:
                    rows.extend(run_stop(stack, f, stop_w or StopWorkload())
                                for _, f in plan[i:j])
                i = j
                continue
            i += 1
            if ref_run is None:
                with stack_for(backend, model, logs, space) as stack:
                    ref_run = drive(stack, w, None, None, bar)
                ref = {(o.user, o.turn): o.tokens for o in ref_run.outcomes}
                if any(v is None for v in ref.values()):
                    raise RuntimeError("the fault-free reference run failed requests")
            with stack_for(backend, model, logs, space) as stack:
                run = drive(stack, w, ref, fault, bar)  # type: ignore[arg-type]
            rows.append(score(run, ref, fault, backend))  # type: ignore[arg-type]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    stops = [r for r in rows if r["fault"] in STOPS]
    lines = [f"{'backend':>9} {'fault':>12} {'requests':>8} {'failed':>6} {'wrong':>6} "
             f"{'recovery s':>10} {'hits before':>11} {'after':>6}"]
    for r in (r for r in rows if r["fault"] not in STOPS):
        lines.append(f"{r['backend']:>9} {r['fault']:>12} {r['requests']:>8} {r['failed']:>6} "
                     f"{r['wrong_tokens']:>6} {str(r['recovery_s']):>10} "
                     f"{str(r['hits_before']):>11} {str(r['hits_after']):>6}")
    return "\n".join(lines) + ("\n\n" + stop_table(stops) if stops else "")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="local,mooncake")
    ap.add_argument("--faults", default=None, help="subset of: " + ", ".join(
        sorted({f for fs in FAULTS.values() for f in fs})))
    ap.add_argument("--quick", action="store_true", help="3 users x 4 turns")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    w = Workload(users=3, turns=4) if args.quick else Workload()
    stop_w = StopWorkload(requests=8, prompt_len=1500) if args.quick else StopWorkload()
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows = matrix(plan_of(args.backends.split(","),
                          args.faults.split(",") if args.faults else None), w, logs, stop_w)
    over = [r["over_miss_s"] for r in rows if r["fault"] in STOPS]
    doc = {"benchmark": "faults", "workload": vars(w), "stop_workload": vars(stop_w),
           "rows": rows,
           "summary": {"wrong_tokens": sum(r["wrong_tokens"] for r in rows),
                       "failed_except_router": sum(r["failed"] for r in rows
                                                   if r["fault"] != "router"),
                       "stop_over_miss_max_s": max((o for o in over if o is not None),
                                                   default=None),
                       "stops_within_target": all(r.get("within_target", True)
                                                  for r in rows)}}
    rw.write(args.out or RESULTS / ("faults_quick.json" if args.quick else "faults.json"),
             doc, table=table(rows), command=rw.command_line(__file__, argv))


if __name__ == "__main__":
    main()
