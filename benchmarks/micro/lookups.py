"""How many prefix lookups a second does one local store answer for 1-16 processes?

Local-store lookups under many clients: ``batch_exists`` of a 512-key chain from 1-16 processes.

    python -m benchmarks.micro.lookups [--quick] [--procs 1,4,16] [--keys 512] [--out FILE.json]

Engine schedulers, workers and the router all ask the store "how much of this prefix do
you hold?" before every request. This benchmark starts one local store, stores a chain of
``--keys`` small objects (each the parent of the next, as the connectors store blocks),
then runs N client processes that each loop ``batch_exists`` of the whole chain for
``--seconds`` (closed loop, every answer checked to be the full chain). Two arms, the same
store and run, one at a time:

* ``rpc``: the coordinator answers each lookup over its socket (``shared_index: false``);
* ``shared``: the client answers from the coordinator's shared-memory index itself
  (``shared_index: true``, the default; docs/store.md §Shared-memory lookups).

Reports lookups/s summed over the processes and per-call latency p50/p99 over every call,
and the ratios shared/rpc. Processes start together (a barrier file) and are timed only
inside the loop.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS, module_command, module_env
from kvcentric.hashing import KeySpace
from kvcentric.store import OK, open_store
from kvcentric.store.local import launcher

ARMS = {"rpc": False, "shared": True}


def chain_keys(n: int) -> list[str]:
    """``n`` keys shaped like the connector's block keys (a fixed prefix + 32 hex chars)."""
    space = KeySpace("bench-lookups", "l" + "0" * 15)
    return space.keys([uuid.UUID(int=i + 1).bytes for i in range(n)])


def child(cfg_json: str, keys_n: int, seconds: float, start_at: float) -> None:
    """One client: loop ``batch_exists`` until the window closes; print latencies (ns)."""
    store = open_store(json.loads(cfg_json))
    keys = chain_keys(keys_n)
    assert store.batch_exists(keys) == keys_n, "the chain must be stored before the run"
    while time.time() < start_at:
        time.sleep(0.001)
    lat: list[int] = []
    end = time.perf_counter() + seconds
    clock = time.perf_counter_ns
    while time.perf_counter() < end:
        t0 = clock()
        got = store.batch_exists(keys)
        lat.append(clock() - t0)
        if got != keys_n:
            raise SystemExit(f"wrong answer {got} != {keys_n}")
    store.close()
    print(json.dumps({"lat_ns": lat, "seconds": seconds}))


def run_point(cfg: dict[str, Any], procs: int, keys_n: int, seconds: float) -> dict[str, Any]:
    start_at = time.time() + 1.0 + 0.15 * procs  # every process imported and connected
    cmd = module_command("benchmarks.micro.lookups",
                         "--child", json.dumps(cfg), str(keys_n), str(seconds), str(start_at))
    ps = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=module_env())
          for _ in range(procs)]
    lat: list[int] = []
    for p in ps:
        out, _ = p.communicate(timeout=seconds + 120)
        if p.returncode != 0:
            raise RuntimeError(f"lookup client failed with exit code {p.returncode}")
        lat.extend(json.loads(out)["lat_ns"])
    a = np.asarray(lat, dtype=np.float64) / 1e3
    return {"procs": procs, "lookups": len(lat), "lookups_per_s": len(lat) / seconds,
            "p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)),
            "max_us": float(a.max())}


def populate(cfg: dict[str, Any], keys_n: int) -> None:
    store = open_store(cfg)
    keys = chain_keys(keys_n)
    buf = np.zeros(4096, np.uint8)
    codes = store.batch_put_from(keys, [buf.ctypes.data] * keys_n, [buf.nbytes] * keys_n,
                                 [None, *keys[:-1]])
    if any(c != OK for c in codes):
        raise RuntimeError(f"could not store the chain: {sorted(set(codes))}")
    store.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    runtime = Path(tempfile.mkdtemp(prefix="kvc-bench-lookups-"))
    base = {"backend": "local", "name": "lookups", "runtime_dir": str(runtime),
            "capacity": "64mb", "prefault": False}
    populate(base, args.keys)
    rows = []
    points = [(arm, n) for arm in ARMS for n in args.procs]
    try:
        for arm, n in tqdm(points, desc="lookup points", unit="point"):
            cfg = {**base, "shared_index": ARMS[arm]}
            rows.append({"arm": arm, **run_point(cfg, n, args.keys, args.seconds)})
    finally:
        launcher.stop(open_store(base).cfg)  # type: ignore[attr-defined]
    by = {(r["arm"], r["procs"]): r for r in rows}
    ratios = {}
    for n in args.procs:
        s, r = by[("shared", n)], by[("rpc", n)]
        ratios[f"procs{n}_lookups_per_s_shared_over_rpc"] = s["lookups_per_s"] / r["lookups_per_s"]
        ratios[f"procs{n}_p99_shared_over_rpc"] = s["p99_us"] / r["p99_us"]
    return {"keys": args.keys, "seconds": args.seconds, "cpus": os.cpu_count(),
            "rows": rows, "ratios": ratios}


def table(res: dict[str, Any]) -> str:
    lines = [f"batch_exists of {res['keys']} keys, closed loop, {res['seconds']} s per point",
             f"{'arm':8} {'procs':>5} {'lookups/s':>11} {'p50 us':>8} {'p99 us':>8} {'max us':>9}"]
    for r in res["rows"]:
        lines.append(f"{r['arm']:8} {r['procs']:>5} {r['lookups_per_s']:>11.0f} "
                     f"{r['p50_us']:>8.0f} {r['p99_us']:>8.0f} {r['max_us']:>9.0f}")
    lines += [f"{k}: {v:.2f}" for k, v in res["ratios"].items()]
    return "\n".join(lines)


def draw(res: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    for arm in ARMS:
        rows = [r for r in res["rows"] if r["arm"] == arm]
        ax1.plot([r["procs"] for r in rows], [r["lookups_per_s"] for r in rows], "o-", label=arm)
        ax2.plot([r["procs"] for r in rows], [r["p99_us"] / 1e3 for r in rows], "o-", label=arm)
    ax1.set(xlabel="client processes", ylabel="lookups/s", xscale="log", title="throughput")
    ax2.set(xlabel="client processes", ylabel="p99 latency (ms)", xscale="log", title="p99")
    ax2.axhline(1.0, color="grey", ls=":", lw=1)
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 s per point")
    ap.add_argument("--procs", default="1,4,16")
    ap.add_argument("--keys", type=int, default=512)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]), float(args.child[2]), float(args.child[3]))
        return
    args.procs = [int(p) for p in args.procs.split(",")]
    if args.quick:
        args.seconds = 1.0
    res = run(args)
    out = args.out or RESULTS / ("lookups_quick.json" if args.quick else "lookups.json")
    rw.write(out, res, table=table(res),
             figures=[rw.Figure("rates", "batch_exists under many clients",
                                lambda p: draw(res, p))],
             command=rw.command_line(__file__, argv))


if __name__ == "__main__":
    main()
