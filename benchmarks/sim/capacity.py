"""How does the store's hit rate grow with capacity, DRAM only vs DRAM + disk?

Hit rate vs capacity: DRAM only vs DRAM + disk, replaying Mooncake's FAST'25 traces
through the local store's own eviction logic (no engine, no I/O).

    python -m benchmarks.sim.capacity --trace-dir DIR [--quick] [--out FILE.json]

``DIR`` holds Mooncake's FAST'25 traces (``FAST25-release/traces/`` of
github.com/kvcache-ai/Mooncake: ``conversation_trace.jsonl``, ``synthetic_trace.jsonl``).

Each trace line is a request with ``hash_ids``: chained prefix-block ids, 512 tokens a
block (the traces are read where they are, never copied). For every
request, in arrival order, the store is asked for the leading run of its blocks (the hit),
the hit blocks are leased and released (refreshing them, and promoting disk objects to
DRAM exactly as a reader's ``settle`` does), then the missing blocks are stored, each
chained to its parent, as an engine's connector would after the prefill. The indexes are
the coordinator's own: :class:`ObjectIndex` (DRAM only: leaf-first LRU, drop on eviction)
and :class:`TieredIndex` (DRAM + disk: write-back demotion above the watermark, clean DRAM
copies dropped first, disk-only leaves dropped for disk space, promotion on read). Disk
writes complete at the end of each request (the bench measures capacity, not bandwidth;
``dropped_undemoted`` says when demotion would have had to be faster than that).

Capacity is counted in blocks (every block is one object of one size). The disk holds
``--disk-fraction`` of the trace's distinct blocks (default 1.0: an SSD sized for the
working set, which is what a node's SSD holds at 100-300 KiB/token). The theoretical
maximum is an infinite cache: the leading run of blocks seen before.

Summary per trace: at the largest swept DRAM size where DRAM only reaches under half of
the maximum, ``dram_only_fraction_of_max`` and ``dram_disk_fraction_of_max``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS
from kvcentric.store.local import disk
from kvcentric.store.local.demoter import WriteDone, WriteJob
from kvcentric.store.local.index import ObjectIndex
from kvcentric.store.local.tiered import PROMOTE, TieredIndex

OBJ = 64  # bytes per block object: the allocator's granule, so capacity = blocks * OBJ
FRACTIONS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 1.0)
QUICK_FRACTIONS = (0.01, 0.05, 0.2, 0.5)


def load(trace_dir: Path, name: str, limit: int | None) -> list[list[int]]:
    with open(trace_dir / f"{name}_trace.jsonl") as fh:
        reqs = [json.loads(line)["hash_ids"] for line in fh]
    return reqs[:limit] if limit else reqs


def infinite_hits(reqs: list[list[int]]) -> int:
    seen: set[int] = set()
    hits = 0
    for ids in reqs:
        n = 0
        while n < len(ids) and ids[n] in seen:
            n += 1
        hits += n
        seen.update(ids)
    return hits


class _SyncDisk:
    """The I/O threads of a TieredIndex, completing every write at the end of a request."""

    def __init__(self) -> None:
        self.jobs: list[WriteJob] = []

    def submit(self, job: Any) -> None:
        if isinstance(job, WriteJob):
            self.jobs.append(job)

    def finish(self, idx: TieredIndex) -> None:
        while self.jobs:
            jobs, self.jobs = self.jobs, []
            for job in jobs:
                idx.demoted(WriteDone(job.token, True, 0, path=job.path), 0.0)
            idx.pump(0.0)


def replay(reqs: list[list[int]], dram_blocks: int, disk_blocks: int | None) -> dict[str, Any]:
    """Replay ``reqs``; ``disk_blocks=None`` is DRAM only."""
    io = _SyncDisk()
    idx: ObjectIndex
    if disk_blocks is None:
        idx = ObjectIndex(dram_blocks * OBJ)
    else:
        idx = TieredIndex(dram_blocks * OBJ, disk_blocks * disk.footprint(OBJ), Path("/sim"),
                          0.8, io.submit)
    hits = total = 0
    for ids in reqs:
        keys = [str(h) for h in ids]
        total += len(keys)
        run = idx.leading_run(keys)
        hits += run
        if run:
            lease_id, got = idx.acquire(keys[:run], 1)
            if isinstance(idx, TieredIndex):
                idx.settle(lease_id, 1, [PROMOTE] * len(got))
            else:
                idx.release(lease_id, 1)
        for i in range(run, len(keys)):
            if idx.reserve(keys[i], OBJ, keys[i - 1] if i else None, 1) >= 0:
                idx.commit(keys[i], 1, None)
        if isinstance(idx, TieredIndex):
            idx.pump(0.0)
            io.finish(idx)
    st = idx.stats()
    out = {"hit_rate": hits / total, "hits": hits, "blocks": total,
           "evictions": st["evictions"]}
    for k in ("dram_hits", "disk_hits", "demotions", "promotions", "dropped_undemoted",
              "disk_evictions"):
        if k in st:
            out[k] = st[k]
    return out


def run_trace(trace_dir: Path, name: str, fractions: tuple[float, ...], disk_fraction: float,
              limit: int | None) -> dict[str, Any]:
    reqs = load(trace_dir, name, limit)
    distinct = len({h for ids in reqs for h in ids})
    total = sum(len(ids) for ids in reqs)
    max_rate = infinite_hits(reqs) / total
    disk_blocks = max(1, int(distinct * disk_fraction))
    rows: list[dict[str, Any]] = []
    for f in fractions:
        dram = max(1, int(distinct * f))
        only = replay(reqs, dram, None)
        both = replay(reqs, dram, disk_blocks)
        rows.append({"dram_fraction": f, "dram_blocks": dram, "dram_only": only,
                     "dram_disk": both})
        print(f"{name}: DRAM {f:6.1%} ({dram} blocks) only {only['hit_rate']:.3f} "
              f"+disk {both['hit_rate']:.3f} max {max_rate:.3f}", flush=True)
    below = [r for r in rows if r["dram_only"]["hit_rate"] < 0.5 * max_rate]
    pick = max(below, key=lambda r: r["dram_blocks"]) if below else rows[0]
    return {"requests": len(reqs), "blocks": total, "distinct_blocks": distinct,
            "disk_blocks": disk_blocks, "max_hit_rate": max_rate, "rows": rows,
            "summary": {
                "dram_blocks": pick["dram_blocks"], "dram_fraction": pick["dram_fraction"],
                "dram_tokens": pick["dram_blocks"] * 512,
                "dram_only_fraction_of_max": pick["dram_only"]["hit_rate"] / max_rate,
                "dram_disk_fraction_of_max": pick["dram_disk"]["hit_rate"] / max_rate}}


def draw(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["traces"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        t = res["traces"][name]
        x = [r["dram_blocks"] * 512 / 1e6 for r in t["rows"]]
        ax.plot(x, [r["dram_only"]["hit_rate"] for r in t["rows"]], "o-", label="DRAM only")
        ax.plot(x, [r["dram_disk"]["hit_rate"] for r in t["rows"]], "s-",
                label=f"DRAM + disk ({t['disk_blocks'] * 512 / 1e6:.0f}M tokens)")
        ax.axhline(t["max_hit_rate"], color="grey", ls="--", label="infinite cache")
        ax.axvline(t["summary"]["dram_tokens"] / 1e6, color="grey", ls=":", lw=1)
        ax.set(xscale="log", xlabel="DRAM capacity (M tokens)", ylabel="block hit rate",
               title=f"{name} trace", ylim=(0, 1))
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(res: dict[str, Any]) -> str:
    lines = ["| trace | DRAM (blocks) | DRAM only | DRAM + disk | infinite |",
             "|---|---:|---:|---:|---:|"]
    for name, t in res["traces"].items():
        for r in t["rows"]:
            lines.append(f"| {name} | {r['dram_blocks']} | {r['dram_only']['hit_rate']:.3f} | "
                         f"{r['dram_disk']['hit_rate']:.3f} | {t['max_hit_rate']:.3f} |")
    for name, t in res["traces"].items():
        s = t["summary"]
        lines.append(f"\n{name}: at {s['dram_blocks']} DRAM blocks, DRAM only "
                     f"{s['dram_only_fraction_of_max']:.1%} of max, DRAM + disk "
                     f"{s['dram_disk_fraction_of_max']:.1%} of max")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="first 2000 requests, 4 DRAM sizes")
    ap.add_argument("--trace-dir", type=Path, required=True,
                    help="the folder of Mooncake's {name}_trace.jsonl files")
    ap.add_argument("--traces", default="conversation,synthetic")
    ap.add_argument("--disk-fraction", type=float, default=1.0,
                    help="disk capacity as a fraction of the trace's distinct blocks")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    fractions = QUICK_FRACTIONS if args.quick else FRACTIONS
    limit = 2000 if args.quick else None
    res: dict[str, Any] = {
        "block_tokens": 512, "disk_fraction": args.disk_fraction,
        "traces": {n: run_trace(args.trace_dir, n, fractions, args.disk_fraction, limit)
                   for n in args.traces.split(",")}}
    res["summary"] = {n: t["summary"] for n, t in res["traces"].items()}
    out = args.out or RESULTS / ("capacity_quick.json" if args.quick else "capacity.json")
    rw.write(out, res, table=table(res),
             figures=[rw.Figure("hit_rate", "Hit rate vs DRAM capacity, DRAM only vs DRAM + disk",
                                lambda p: draw(res, p))],
             command=rw.command_line(__file__, argv))


if __name__ == "__main__":
    main()
