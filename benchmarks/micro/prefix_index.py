"""How fast is the router's prefix index on a trace replay, next to Dynamo's indexer?

    python -m benchmarks.micro.prefix_index [--quick] [--trace FILE] [--workers 16,64]
        [--out FILE.json]

Replays a Mooncake trace (``../shared/traces/conversation_trace.jsonl``; each 512-token
hash id split into 4 blocks of 128 tokens, as vLLM CPU pages) through the router's
:class:`kvcentric.router.fleet.prefix_index.PrefixIndex` the way a router sees a fleet: per
request, one **lookup** (the request's blocks matched against every worker in one walk),
the request placed on the worker with the longest match (ties: fewest blocks held), and
that worker's engine cache (an LRU of ``--cache-blocks`` blocks, simulated beside the
index) reports the blocks it **stored** and the ones it **evicted** to make room, which
are applied to the index as the engine's KV events would be (``add``/``remove``). Timed
on one thread with ``perf_counter_ns``: each lookup, and the whole replay; block ops =
blocks looked up + stored + removed, as Dynamo counts them (its ``mooncake_bench``).

Also timed: the same stored blocks arriving as vLLM ``BlockStored`` events with token ids
through the router's :class:`kvcentric.router.fleet.kv_events.EventTranslator` (what a router
fed by engine events does per block: rehash the tokens into our chained blocks).

Reference (ai-dynamo/dynamo PR 11372, ``lib/bench/kv_router/CKF_CRTC_CROSSOVER.md``):
CRTC (concurrent compressed radix tree, Rust) on the Mooncake arXiv trace x20, 16
workers, 10M synthetic memberships per worker, 64-core EPYC 7702P with 8 event and 16
query threads: lookup 2.38 us p50 / 10.12 us p99 at 6.63M block ops/s offered, keep-up
ceiling 13.26M block ops/s. Our replay is one Python thread on this machine, the
conversation trace (the arXiv trace is not in ../shared/traces), no synthetic ballast.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS, ROOT
from kvcentric.bench_serving.trace import read_trace
from kvcentric.hashing import block_hashes, hash_seed
from kvcentric.router.fleet.kv_events import EventTranslator
from kvcentric.router.fleet.prefix_index import PrefixIndex

TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
SPLIT = 4  # blocks per trace hash id (512 tokens -> 4 x 128)
DYNAMO: dict[str, Any] = {"lookup_p50_us": 2.38, "lookup_p99_us": 10.12, "block_ops_per_s": 13.26e6,
          "source": "ai-dynamo/dynamo PR 11372 (CKF_CRTC_CROSSOVER.md): CRTC, D=16, "
                    "Mooncake arXiv trace x20, 64-core EPYC 7702P"}


def blocks_of(hash_ids: tuple[int, ...]) -> list[bytes]:
    """16-byte block names: ``SPLIT`` per trace hash id (ids are chained: the name of a
    sub-block encodes its id and position, so equal ids give equal prefixes)."""
    return [h.to_bytes(12, "little") + k.to_bytes(4, "little")
            for h in hash_ids for k in range(SPLIT)]


class EngineCache:
    """A worker's engine cache: an LRU of ``capacity`` blocks; ``store`` returns the
    blocks newly stored and those evicted for them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[bytes, None] = OrderedDict()

    def store(self, blocks: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        new = []
        for b in blocks:
            if b in self.lru:
                self.lru.move_to_end(b)
            else:
                self.lru[b] = None
                new.append(b)
        gone = []
        while len(self.lru) > self.capacity:
            gone.append(self.lru.popitem(last=False)[0])
        return new, gone


def replay(requests: list[list[bytes]], workers: int, cache_blocks: int) -> dict[str, Any]:
    index = PrefixIndex()
    for w in range(workers):
        index.add_slot(w, cache_blocks * 4)  # the engines' events bound it, not its LRU
    caches = [EngineCache(cache_blocks) for _ in range(workers)]
    held = [0] * workers
    mask = (1 << workers) - 1
    lookups = np.empty(len(requests), dtype=np.int64)
    ops = {"lookup": 0, "store": 0, "remove": 0}
    hits = 0
    ns = time.perf_counter_ns
    t0 = ns()
    for i, blocks in enumerate(requests):
        a = ns()
        runs = index.match(blocks, mask)
        lookups[i] = ns() - a
        best = max(range(workers), key=lambda w: (runs.get(w, 0), -held[w]))
        hits += runs.get(best, 0)
        new, gone = caches[best].store(blocks)
        index.add(best, new)
        index.remove(best, gone)
        held[best] = len(caches[best].lru)
        ops["lookup"] += len(blocks)
        ops["store"] += len(new)
        ops["remove"] += len(gone)
    total_s = (ns() - t0) / 1e9
    n_ops = sum(ops.values())
    return {"workers": workers, "cache_blocks": cache_blocks, "requests": len(requests),
            "lookup_p50_us": float(np.percentile(lookups, 50)) / 1e3,
            "lookup_p99_us": float(np.percentile(lookups, 99)) / 1e3,
            "lookup_mean_us": float(lookups.mean()) / 1e3,
            "blocks_per_lookup": ops["lookup"] / len(requests),
            "block_ops": ops, "replay_s": total_s, "block_ops_per_s": n_ops / total_s,
            "hit_blocks_share": hits / max(1, ops["lookup"])}


def translator_cost(requests: list[list[bytes]], n: int, page: int = 128) -> dict[str, Any]:
    """Per block, the router's cost of a ``BlockStored`` event with token ids (its
    translation into our chained blocks, then the index add)."""
    rnd = random.Random(0)
    tr = EventTranslator("bench", page)
    index = PrefixIndex()
    index.add_slot(0, 1 << 22)
    events: list[dict[str, Any]] = []
    for k, blocks in enumerate(requests[:n]):
        toks = [rnd.randrange(10, 8000) for _ in range(len(blocks) * page)]
        hashes = [int.from_bytes(b[:8], "little") ^ k for b in blocks]
        events.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                       "token_ids": toks, "block_size": page, "extra_keys": None})
    nblocks = sum(len(e["block_hashes"]) for e in events)
    t0 = time.perf_counter_ns()
    for e in events:
        index.add(0, tr.stored(e))
    dt = (time.perf_counter_ns() - t0) / 1e9
    check = block_hashes(events[0]["token_ids"], page, hash_seed("bench"))
    assert set(check) <= set(index._owners)
    return {"events": len(events), "blocks": nblocks, "seconds": dt,
            "blocks_per_s": nblocks / dt, "us_per_block": dt / nblocks * 1e6}


def table(rows: list[dict[str, Any]], tr: dict[str, Any]) -> str:
    head = (f"{'workers':>7} {'requests':>8} {'blk/lookup':>10} {'p50 us':>8} {'p99 us':>8} "
            f"{'block ops/s':>12} {'hit share':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['workers']:>7} {r['requests']:>8} {r['blocks_per_lookup']:>10.1f} "
                     f"{r['lookup_p50_us']:>8.2f} {r['lookup_p99_us']:>8.2f} "
                     f"{r['block_ops_per_s']:>12,.0f} {r['hit_blocks_share']:>9.1%}")
    lines.append(f"{'Dynamo CRTC':>7} {'':>8} {'':>10} {DYNAMO['lookup_p50_us']:>8.2f} "
                 f"{DYNAMO['lookup_p99_us']:>8.2f} {DYNAMO['block_ops_per_s']:>12,.0f}  "
                 "(published; 64 cores, 24 threads)")
    lines.append(f"events with token ids through the translator: {tr['us_per_block']:.2f} us "
                 f"per block ({tr['blocks_per_s']:,.0f} blocks/s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--workers", default="16,64")
    ap.add_argument("--cache-blocks", type=int, default=16384,
                    help="engine cache per worker, blocks (Dynamo's run: 16384)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    recs = read_trace(args.trace, 2000 if args.quick else None)
    requests = [blocks_of(r.hash_ids) for r in sorted(recs, key=lambda r: r.timestamp_ms)]
    rows = [replay(requests, int(w), args.cache_blocks)
            for w in tqdm(args.workers.split(","), desc="workers")]
    tr = translator_cost(requests, 200 if args.quick else 2000)
    main_row = next((r for r in rows if r["workers"] == 16), rows[0])
    summary = {"lookup_p50_us": main_row["lookup_p50_us"],
               "lookup_p99_us": main_row["lookup_p99_us"],
               "block_ops_per_s": main_row["block_ops_per_s"],
               "lookup_p99_over_dynamo": main_row["lookup_p99_us"] / DYNAMO["lookup_p99_us"],
               "block_ops_dynamo_over_ours": DYNAMO["block_ops_per_s"]
               / main_row["block_ops_per_s"],
               "within_10x_of_dynamo_per_lookup":
                   main_row["lookup_p99_us"] <= 10 * DYNAMO["lookup_p99_us"],
               "translator_us_per_block": tr["us_per_block"],
               **{f"lookup_{q}_us_{r['workers']}_workers": r[f"lookup_{q}_us"]
                  for r in rows for q in ("p50", "p99")}}
    doc = {"summary": summary, "rows": rows, "translator": tr, "dynamo": DYNAMO,
           "trace": str(args.trace), "split": SPLIT, "quick": args.quick}
    out = args.out or RESULTS / f"prefix_index{'_quick' if args.quick else ''}.json"
    rw.write(out, doc, table(rows, tr), command=rw.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
