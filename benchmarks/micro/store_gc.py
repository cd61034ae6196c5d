"""Does Python's garbage collector stall the local store's coordinator as its index grows?

The coordinator's call latency under churn, with its heap policy (``gc_freeze: true``, the
default; :mod:`kvcentric.store.local.heap`) and with CPython's default policy.

    python -m benchmarks.micro.store_gc [--objects 400000] [--churn 400] [--reps 3]
                                        [--out FILE.json]

Per run: a fresh local store holding ``--objects`` objects of 1 KiB in prefix chains (as
engines store blocks, each the parent of the next), then ``--churn`` calls each putting
1000 new objects (every put evicts as many old ones), one call at a time from this
process; each call's latency is recorded (a put is two round trips, reserve and commit).
With the default policy, the coordinator runs a full collection each time a quarter of
its index was replaced, and every call waiting meanwhile waits for it; with the heap
policy a collection scans only what the last second allocated. The arms alternate,
``--reps`` runs each, in one process; per arm: the median over runs of each run's call
p50, p99 and max, with their ranges, and the calls over the engines' default hot bound
(``hot_timeout_s``, 100 ms), which a lookup or lease waiting on the coordinator would
overrun. The shared lookup index is off (it holds a fraction of these objects at most;
lookups are not what is timed).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS
from kvcentric.config import StoreConfig
from kvcentric.store import OK, open_store
from kvcentric.store.local import launcher

OBJ = 1024
CHAIN = 64
PER_CALL = 1000
HOT_BOUND_S = 0.1  # StoreConfig.hot_timeout_s's default


def put_calls(store: Any, tag: str, calls: int, src: np.ndarray) -> list[float]:
    """``calls`` puts of ``PER_CALL`` chained objects; each call's seconds."""
    out = []
    for c in range(calls):
        keys = [f"{tag}/{c}/{i}" for i in range(PER_CALL)]
        parents = [None if i % CHAIN == 0 else keys[i - 1] for i in range(PER_CALL)]
        t0 = time.perf_counter()
        codes = store.batch_put_from(keys, [src.ctypes.data] * PER_CALL, [OBJ] * PER_CALL,
                                     parents)
        out.append(time.perf_counter() - t0)
        if codes != [OK] * PER_CALL:
            raise RuntimeError(f"puts refused: {sorted(set(codes))}")
    return out


def one_run(gc_freeze: bool, objects: int, churn: int) -> dict[str, Any]:
    """A fresh store filled with ``objects``, then ``churn`` timed calls."""
    rt = tempfile.mkdtemp(prefix="kvc-gc-")
    cfg = StoreConfig.from_dict({
        "name": f"gc{uuid.uuid4().hex[:8]}", "runtime_dir": rt,
        # the objects and their alignment, and room for one call more (eviction frees first)
        "capacity_bytes": (objects + PER_CALL) * OBJ, "prefault": False,
        "shared_index": False, "gc_freeze": gc_freeze, "op_timeout_s": 60.0})
    src = np.zeros(OBJ, np.uint8)
    try:
        with open_store(cfg) as s:
            put_calls(s, "fill", objects // PER_CALL, src)
            lat = put_calls(s, "churn", churn, src)
            st = s.stats()
    finally:
        launcher.stop(cfg)
    ms = sorted(x * 1000 for x in lat)
    return {"p50_ms": statistics.median(ms), "p99_ms": ms[int(0.99 * (len(ms) - 1))],
            "max_ms": ms[-1], "over_hot_bound": sum(1 for x in lat if x > HOT_BOUND_S),
            "keys": st["keys"], "evictions": st["evictions"],
            "gc_frozen": st["gc_frozen"], "gc_young": st["gc_young"]}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in ("p50_ms", "p99_ms", "max_ms", "over_hot_bound"):
        xs = [r[k] for r in runs]
        out[k] = {"median": statistics.median(xs), "range": [min(xs), max(xs)]}
    return out


def table(summary: dict[str, Any]) -> str:
    lines = [f"{'arm':>8} {'p50 ms':>16} {'p99 ms':>18} {'max ms':>20} {'calls > 100 ms':>16}"]
    for arm, s in summary.items():
        cells = [f"{s[k]['median']:.1f} [{s[k]['range'][0]:.1f}-{s[k]['range'][1]:.1f}]"
                 for k in ("p50_ms", "p99_ms", "max_ms")]
        o = s["over_hot_bound"]
        lines.append(f"{arm:>8} {cells[0]:>16} {cells[1]:>18} {cells[2]:>20} "
                     f"{o['median']:>6} [{o['range'][0]}-{o['range'][1]}]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--objects", type=int, default=400_000)
    ap.add_argument("--churn", type=int, default=400, help="timed calls per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "store_gc.json")
    args = ap.parse_args(argv)
    if args.objects < PER_CALL or args.churn < 1 or args.reps < 1:
        ap.error(f"--objects must be >= {PER_CALL}; --churn and --reps >= 1")
    arms = {"freeze": True, "default": False}
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    for _ in range(args.reps):  # alternating, so drift of the box hits both arms alike
        for arm, on in arms.items():
            runs[arm].append(one_run(on, args.objects, args.churn))
    summary = {arm: summarise(rs) for arm, rs in runs.items()}
    doc = {"benchmark": "store_gc", "objects": args.objects, "object_bytes": OBJ,
           "churn_calls": args.churn, "objects_per_call": PER_CALL, "reps": args.reps,
           "runs": runs, "summary": summary}
    rw.write(args.out, doc, table=table(summary), command=rw.command_line(__file__, argv))


if __name__ == "__main__":
    main()
