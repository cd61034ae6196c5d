"""Does the router's memory stay flat over tens of thousands of requests?

    python -m benchmarks.reliability.soak_router [--requests 20000 | --minutes M] [--rate 40]
                                     [--users 8] [--mix mixed|soak] [--latency-ms LO,HI]
                                     [--pages 2048] [--no-store] [--trace] [--out FILE]

The router (``kvcentric.router.cli serve``, its own process) in front of two stub engines
(:mod:`benchmarks.lib.stub_engine`: instant answers, vLLM's ``/metrics`` gauges, and, unless
``--no-store``, the prompt's blocks put in a local store as the connector would), so no
engine's memory or CPU is in the way. ``--users`` closed-loop conversations at ``--rate``
requests/s in all: each conversation is 4 turns of a growing prompt (half of them after
one of ``--shared`` shared system prompts, the rest from scratch), as token ids or text
to ``/v1/completions`` or as messages to ``/v1/chat/completions``, 30% streamed, half
the users on keep-alive connections and half on a new one per request; every
conversation is new, so the router sees new prefixes all the time. ``--mix soak``: the
requests of :mod:`benchmarks.reliability.soak` instead (token ids, not streamed, a new connection
each); ``--latency-ms``: the stubs take that long per answer, so requests overlap.

Every ``--sample-s`` seconds: the router's RSS (``/proc/PID/status`` VmRSS) and fds, the
stubs' RSS, and the router's bookkeeping sizes from ``/instances`` (resident blocks).
Reported: the router's RSS slope in MiB per 1000 requests after the warm-up (the first
``--warmup`` fraction of requests) and over the last quarter alone (a slope falling
towards 0 is an allocator settling; one that holds is a leak).

The router runs inside :mod:`benchmarks.reliability.router_probe`, which adds to every sample its
bookkeeping sizes (prefix heat keys, prefix index blocks, ...) and the allocators' own
figures (pymalloc arenas and live bytes, glibc heap and bytes in use), so RSS growth can
be split into Python objects, allocator slack and native memory; at the end of the
warm-up and at the end it also counts live objects by type (``growth`` in the JSON).
``--trace``: tracemalloc runs in the router too and the allocation sites that grew most
between those two points are reported (the router's RSS is then inflated by the tracing
itself: judge slopes from an untraced run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from tqdm import tqdm

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS, module_command
from benchmarks.lib.procfs import slope, usage
from kvcentric.config import StoreConfig
from kvcentric.store.local import launcher
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import free_port, spawn, stop_group, wait_http


def snapshot(proc: subprocess.Popen[bytes], snapdir: Path, n: int) -> None:
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 300
    while not (snapdir / f"snap{n}.done").exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the router wrote no snapshot {n}")
        time.sleep(0.2)


def growth(snapdir: Path, top: int = 15) -> dict[str, Any]:
    """Between the two snapshots: the router's bookkeeping sizes, the object types whose
    count changed most and (traced runs) the allocation sites, by line and by whole
    traceback, that grew most."""
    import tracemalloc

    ta = json.loads((snapdir / "snap0.types.json").read_text())
    tb = json.loads((snapdir / "snap1.types.json").read_text())
    types = sorted(((t, tb.get(t, 0) - ta.get(t, 0)) for t in {*ta, *tb}),
                   key=lambda kv: -abs(kv[1]))[:top]
    sa = json.loads((snapdir / "snap0.sizes.json").read_text())
    sb = json.loads((snapdir / "snap1.sizes.json").read_text())
    out: dict[str, Any] = {"object_types": [{"type": t, "count": c} for t, c in types],
                           "sizes": {k: [sa.get(k), sb.get(k)] for k in sorted({*sa, *sb})}}
    if not (snapdir / "snap0.tracemalloc").exists():
        return out
    skip = [tracemalloc.Filter(False, tracemalloc.__file__),
            tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
            tracemalloc.Filter(False, "<unknown>")]
    a = tracemalloc.Snapshot.load(str(snapdir / "snap0.tracemalloc")).filter_traces(skip)
    b = tracemalloc.Snapshot.load(str(snapdir / "snap1.tracemalloc")).filter_traces(skip)

    def total(s: tracemalloc.Snapshot) -> int:
        return sum(st.size for st in s.statistics("filename"))

    by_line = [{"site": str(d.traceback[0]), "kib": round(d.size_diff / 1024, 1),
                "count": d.count_diff, "kib_now": round(d.size / 1024, 1)}
               for d in b.compare_to(a, "lineno")[:top]]
    by_trace = [{"kib": round(d.size_diff / 1024, 1), "count": d.count_diff,
                 "traceback": [str(f) for f in d.traceback]}
                for d in b.compare_to(a, "traceback")[:5]]
    return {"traced_mib": [round(total(a) / 2**20, 2), round(total(b) / 2**20, 2)],
            "by_line": by_line, "by_traceback": by_trace, **out}


# ---- the workload ----
@dataclass
class Load:
    target: int | None
    deadline: float
    rate: float
    requests: int = 0
    failed: int = 0
    rejected: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    next_t: float = 0.0

    def done(self) -> bool:
        return (self.target is not None and self.requests >= self.target) or \
            time.monotonic() >= self.deadline

    async def pace(self) -> None:
        now = time.monotonic()
        self.next_t = max(self.next_t + 1 / self.rate, now)
        await asyncio.sleep(self.next_t - now)


def words(rnd: random.Random, n: int) -> str:
    return " ".join("".join(rnd.choices("abcdefghijklmnopqrstuvwxyz", k=rnd.randrange(2, 9)))
                    for _ in range(n))


def conversation(rnd: random.Random, shared: list[tuple[list[int], str]], mix: str
                 ) -> list[tuple[str, dict[str, Any]]]:
    """One 4-turn conversation: (path, body) per turn, the prompt growing each turn;
    ``mix`` "soak": :mod:`benchmarks.reliability.soak`'s (token ids, not streamed, no shared
    prompt)."""
    if mix == "soak":
        shared = []
    kind = "tokens" if mix == "soak" else \
        rnd.choices(("tokens", "text", "chat"), (0.5, 0.2, 0.3))[0]
    sys_ids, sys_text = rnd.choice(shared) if shared and rnd.random() < 0.5 else ([], "")
    ids = sys_ids + [rnd.randrange(4, 4000) for _ in range(rnd.randrange(200, 600))]
    text = (sys_text + " " + words(rnd, rnd.randrange(80, 240))).strip()
    messages: list[dict[str, str]] = [{"role": "system", "content": sys_text}] if sys_text \
        else []
    messages.append({"role": "user", "content": words(rnd, rnd.randrange(80, 240))})
    turns = []
    for _ in range(4):
        stream = mix != "soak" and rnd.random() < 0.3
        body: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "temperature": 0.0,
                                "stream": stream}
        if kind == "chat":
            turns.append(("/v1/chat/completions", {**body, "messages": list(messages)}))
            messages += [{"role": "assistant", "content": "ok ok ok"},
                         {"role": "user", "content": words(rnd, rnd.randrange(15, 50))}]
        elif kind == "text":
            turns.append(("/v1/completions", {**body, "prompt": text}))
            text += " ok ok ok " + words(rnd, rnd.randrange(15, 50))
        else:
            turns.append(("/v1/completions", {**body, "prompt": list(ids)}))
            ids += [rnd.randrange(4, 4000) for _ in range(rnd.randrange(40, 120))]
    return turns


async def send(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> int:
    if body["stream"]:
        async with client.stream("POST", path, json=body) as r:
            async for _ in r.aiter_bytes():
                pass
        return r.status_code
    return (await client.post(path, json=body)).status_code


async def user(url: str, seed: int, fresh: bool, shared: list[tuple[list[int], str]],
               mix: str, load: Load, bar: tqdm) -> None:
    """One closed-loop user; ``fresh``: a new connection per request (else keep-alive)."""
    rnd = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while not load.done():
            for path, body in conversation(rnd, shared, mix):
                if load.done():
                    return
                await load.pace()
                try:
                    if fresh:
                        async with httpx.AsyncClient(base_url=url, timeout=60) as once:
                            status = await send(once, path, body)
                    else:
                        status = await send(client, path, body)
                    err = f"HTTP {status}"
                except httpx.HTTPError as exc:
                    status, err = 0, f"{type(exc).__name__}: {exc}"[:160]
                load.requests += 1
                load.rejected += status == 429
                if status not in (200, 429):
                    load.failed += 1
                    load.errors[err] += 1
                bar.update()


def rss_parts(pid: int) -> dict[str, float]:
    """The router's RSS split (MiB): anonymous (heap), file-backed (code, mapped files),
    shared memory (e.g. the store's shared lookup index)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = line.split(":")[0]
            if key in ("RssAnon", "RssFile", "RssShmem"):
                out[f"router_{key[3:].lower()}_mib"] = round(int(line.split()[1]) / 1024, 2)
    except OSError:
        pass
    return out


def probe(router: subprocess.Popen[bytes], outdir: Path) -> dict[str, Any]:
    """The router's own numbers (:mod:`benchmarks.reliability.router_probe`), asked by SIGUSR2."""
    path = outdir / "probes.jsonl"
    n = len(path.read_text().splitlines()) if path.exists() else 0
    router.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and router.poll() is None:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) > n:
            row = json.loads(lines[n])
            row.pop("t", None)
            return row
        time.sleep(0.05)
    return {}


def sample(router: subprocess.Popen[bytes], stub: subprocess.Popen[bytes], url: str,
           load: Load, t0: float, outdir: Path) -> dict[str, Any]:
    rss, fds = usage([router.pid])
    stub_rss, _ = usage([stub.pid])
    row: dict[str, Any] = {"t": round(time.monotonic() - t0, 1), "requests": load.requests,
                           "router_rss_mib": round(rss, 2), "router_fds": fds,
                           "stub_rss_mib": round(stub_rss, 2), **rss_parts(router.pid),
                           **probe(router, outdir)}
    try:
        info = httpx.get(url + "/instances", timeout=10).json()
        row["resident_blocks"] = sum(i["resident_blocks"] for i in info["instances"])
        row["store_queries"] = info["store"]["queries"]
    except (httpx.HTTPError, ValueError, KeyError):
        pass
    return row


async def drive(args: argparse.Namespace, url: str, router: subprocess.Popen[bytes],
                stub: subprocess.Popen[bytes], outdir: Path
                ) -> tuple[Load, list[dict[str, Any]]]:
    rnd = random.Random(args.seed)
    shared = [([rnd.randrange(4, 4000) for _ in range(rnd.randrange(200, 500))],
               words(rnd, rnd.randrange(80, 200))) for _ in range(args.shared)]
    budget = args.minutes * 60 if args.minutes else 1e9
    load = Load(None if args.minutes else args.requests, time.monotonic() + budget, args.rate)
    warm_at = args.warmup * (args.requests if not args.minutes else args.rate * budget)
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    loop = asyncio.get_running_loop()
    with tqdm(desc="requests", unit="req", total=load.target, mininterval=5) as bar:
        users = [asyncio.create_task(user(url, args.seed * 1000 + u,
                                          args.mix == "soak" or u % 2 == 1, shared, args.mix,
                                          load, bar))
                 for u in range(args.users)]
        warm = False
        while not all(u.done() for u in users):
            samples.append(await loop.run_in_executor(None, sample, router, stub, url, load,
                                                      t0, outdir))
            if not warm and load.requests >= warm_at:
                await loop.run_in_executor(None, snapshot, router, outdir, 0)
                warm = True
            await asyncio.wait(users, timeout=args.sample_s)
        for u in users:
            u.result()
    await asyncio.sleep(2)  # streams and the store view's worker settle
    samples.append(sample(router, stub, url, load, t0, outdir))
    snapshot(router, outdir, 1)
    return load, samples


# ---- the stack ----
def run(args: argparse.Namespace) -> tuple[Load, list[dict[str, Any]], dict[str, Any]]:
    model = str(build_model("tiny", Path.cwd() / ".models" / "tiny"))
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    store_cfg: StoreConfig | None = None
    store: dict[str, Any] | None = None
    if not args.no_store:
        rt = tempfile.mkdtemp(prefix="kvc-soak-router-", dir="/dev/shm")
        store = {"name": f"sr{uuid.uuid4().hex[:6]}", "capacity": args.capacity,
                 "runtime_dir": rt}
        store_cfg = StoreConfig.from_dict({**store, "prefault": False})
        launcher.ensure_running(store_cfg)
    ports = [free_port(), free_port()]
    stub_cmd = module_command("benchmarks.lib.stub_engine", "--ports",
                              ",".join(map(str, ports)), "--tokenizer", model,
                              "--pages", str(args.pages), "--latency-ms", args.latency_ms)
    if store is not None:
        stub_cmd += ["--store", json.dumps(store)]
    port = free_port()
    cfg = {"model": "tiny", "tokenizer": model, "listen": {"port": port},
           "instances": [{"url": f"http://127.0.0.1:{p}", "role": "both", "name": f"e{i}"}
                         for i, p in enumerate(ports)],
           "slo": {"ttft_ms": 60000, "tbt_ms": 1000},
           "health": {"interval_s": 0.5, "timeout_s": 2, "unhealthy_after": 2},
           "replication": {"enabled": args.replication}, "log_level": "warning"}
    if store is not None:
        cfg["store"] = store
    cfg_path = logs / f"soak-router-{port}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    outdir = Path(tempfile.mkdtemp(prefix="kvc-soak-router-probe-"))
    router_cmd = module_command("benchmarks.reliability.router_probe", str(cfg_path),
                                str(outdir), *(["--trace"] if args.trace else []))
    stub = router = None
    url = f"http://127.0.0.1:{port}"
    try:
        stub = spawn(stub_cmd, logs / "soak-router-stub.log")
        for p in ports:
            wait_http(f"http://127.0.0.1:{p}/health", stub, logs / "soak-router-stub.log")
        router = spawn(router_cmd, logs / "soak-router.log")
        wait_http(url + "/health", router, logs / "soak-router.log")
        load, samples = asyncio.run(drive(args, url, router, stub, outdir))
        trace = growth(outdir)
    finally:
        stop_group(router)
        stop_group(stub)
        if store_cfg is not None:
            launcher.stop(store_cfg)
            shutil.rmtree(store_cfg.local.runtime_dir, ignore_errors=True)  # our mkdtemp
    return load, samples, trace


PARTS = ("router_rss_mib", "router_anon_mib", "pymalloc_arenas_mib", "pymalloc_used_mib",
         "glibc_heap_mib", "glibc_in_use_mib", "glibc_mmapped_mib")


def summarize(load: Load, samples: list[dict[str, Any]], warmup: float) -> dict[str, Any]:
    last = samples[-1]["requests"]
    warm = next(s for s in samples if s["requests"] >= warmup * last)
    parts = [k for k in PARTS if all(k in s for s in samples)]
    return {"requests": load.requests, "failed": load.failed, "rejected": load.rejected,
            "errors": dict(load.errors.most_common(5)),
            "minutes": round(samples[-1]["t"] / 60, 1),
            "rss_slope_mib_per_1k_requests": round(slope(samples, "router_rss_mib", warmup), 3),
            "rss_slope_last_quarter": round(slope(samples, "router_rss_mib", 0.75), 3),
            "rss_mib_start_warm_end": [samples[0]["router_rss_mib"], warm["router_rss_mib"],
                                       samples[-1]["router_rss_mib"]],
            "slopes_after_warmup": {k: round(slope(samples, k, warmup), 3) for k in parts},
            "slopes_last_quarter": {k: round(slope(samples, k, 0.75), 3) for k in parts},
            "warm_end": {k: [warm.get(k), samples[-1].get(k)]
                         for k in (*parts, "heat_keys", "index_blocks", "threads")},
            "stub_rss_slope_mib_per_1k_requests": round(slope(samples, "stub_rss_mib",
                                                              warmup), 3),
            "fds_start_end": [samples[0]["router_fds"], samples[-1]["router_fds"]]}


def table(summary: dict[str, Any], samples: list[dict[str, Any]], growth_: dict[str, Any],
          rows: int = 16) -> str:
    s = summary
    a, w, b = s["rss_mib_start_warm_end"]
    cols = (("requests", "requests", "{:>9}"), ("t (s)", "t", "{:>6.0f}"),
            ("RSS", "router_rss_mib", "{:>7.2f}"), ("anon", "router_anon_mib", "{:>7.2f}"),
            ("py arenas", "pymalloc_arenas_mib", "{:>9.2f}"),
            ("py used", "pymalloc_used_mib", "{:>7.2f}"),
            ("libc heap", "glibc_heap_mib", "{:>9.2f}"),
            ("libc used", "glibc_in_use_mib", "{:>9.2f}"),
            ("heat keys", "heat_keys", "{:>9}"), ("index blocks", "index_blocks", "{:>12}"))
    lines = [f"{s['requests']} requests in {s['minutes']} min, {s['failed']} failed, "
             f"{s['rejected']} rejected (429); router memory in MiB:",
             " ".join(f"{h:>{_width(f)}}" for h, _, f in cols)]
    step = max(1, len(samples) // rows)
    shown = samples[::step] + ([] if (len(samples) - 1) % step == 0 else samples[-1:])
    for r in shown:
        lines.append(" ".join(f.format(r[k]) if k in r else f"{'-':>{_width(f)}}"
                              for _, k, f in cols))
    lines.append(f"router RSS {a:.1f} -> {w:.1f} (warm) -> {b:.1f} MiB; slope after warm-up "
                 f"{s['rss_slope_mib_per_1k_requests']:.3f} MiB/1k requests, last quarter "
                 f"{s['rss_slope_last_quarter']:.3f}")
    lines.append("slopes after warm-up (MiB/1k requests): " + ", ".join(
        f"{k.removesuffix('_mib')} {v:+.3f}" for k, v in s["slopes_after_warmup"].items()))
    if "by_line" in growth_:
        t = growth_["traced_mib"]
        lines.append(f"tracemalloc: traced {t[0]} -> {t[1]} MiB; growth by line:")
        lines += [f"  {d['kib']:>9.1f} KiB {d['count']:>+8} blocks  {d['site']}"
                  for d in growth_["by_line"][:10]]
    lines.append("live objects by type: " + ", ".join(
        f"{d['type']} {d['count']:+}" for d in growth_["object_types"][:8]))
    return "\n".join(lines)


def _width(fmt: str) -> int:
    return int(re.search(r">(\d+)", fmt).group(1))  # type: ignore[union-attr]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--minutes", type=float, default=None, help="run for this long instead")
    ap.add_argument("--rate", type=float, default=40.0, help="requests per second, in all")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--shared", type=int, default=32, help="shared system prompts")
    ap.add_argument("--mix", choices=("mixed", "soak"), default="mixed",
                    help="mixed: tokens/text/chat, streamed or not; soak: soak.py's requests")
    ap.add_argument("--latency-ms", default="0,0", help="LO,HI: the stubs' answer time")
    ap.add_argument("--pages", type=int, default=2048, help="KV pages each stub reports")
    ap.add_argument("--capacity", default="16mb", help="the local store's capacity")
    ap.add_argument("--no-store", action="store_true", help="no store (the router's view off)")
    ap.add_argument("--replication", action="store_true", help="hot-prefix replication on")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", action="store_true", help="tracemalloc in the router")
    ap.add_argument("--out", type=Path, default=RESULTS / "soak_router.json")
    args = ap.parse_args(argv)
    load, samples, trace = run(args)
    summary = summarize(load, samples, args.warmup)
    doc = {"benchmark": "soak_router", "config": {k: str(v) for k, v in vars(args).items()},
           "summary": summary, "growth": trace, "samples": samples}
    rw.write(args.out, doc, table=table(summary, samples, trace),
             command=rw.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
