"""How fast are store puts and gets, next to a plain memcpy of the same bytes?

Store put/get bandwidth against a plain memcpy of the same bytes, in one run.

    python -m benchmarks.micro.store [--backend local] [--quick] [--disk-dir DIR]
                                     [--events] [--out FILE.json]

For each object size (256 KiB - 2 MiB) it puts and gets batches of objects from this
process, then from a second process, and times ``np.copyto`` of the same objects in the
same process as the baseline. In this process it also puts each batch as the connectors
write (``batch_alloc``, a memmove per slot, ``batch_commit``) and times the copies of that
put alone: ``arena_copy_vs_memcpy`` is the floor any put reaches here (the same bytes,
into arena memory that rotates over the store rather than one hot destination), and
``put_vs_arena_copy`` what the round trips and the coordinator's bookkeeping add to it.
Destinations are pre-touched and the store runs in steady state (capacity = 4x a batch,
so eviction recycles mapped pages), and the CPU caches are evicted before every timed
copy, so no arm profits from the previous one's cache. Reports medians over rounds and
the ratios store/memcpy. ``--disk-dir`` gives the local store a disk tier there (8x a
batch): puts then pay for the tier's bookkeeping and, in steady state, wait for its
demotions (the store writes each batch to disk before DRAM can drop it).
``--events`` turns on the store's KV events (docs/store.md §KV events) with a subscriber
draining them in this process: every object is a block key, so every put and eviction
publishes (keys are block keys in every run, so runs with and without compare).
``--events-ab N`` measures what they cost: N rounds alternating a run without and a run
with events, each summary ratio's median and range per side (``store_events_ab*.json``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from tqdm import tqdm

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS, module_command, module_env
from kvcentric.store import OK, open_store
from kvcentric.store.local import launcher

KiB, MiB = 1 << 10, 1 << 20


_SCRATCH = np.zeros(0, np.uint8)


def cold() -> None:
    """Evict CPU caches (write 64 MiB) so every timed copy starts from memory, not L3."""
    global _SCRATCH
    if _SCRATCH.size == 0:
        _SCRATCH = np.empty(64 * MiB, np.uint8)
    _SCRATCH.fill(_SCRATCH[0] + 1)


def block_key(*parts: object) -> str:
    """A block key of the key spec (so the store's KV events publish it), unique per
    ``parts``."""
    digest = xxhash.xxh3_128_hexdigest("/".join(map(str, parts)).encode())
    return f"kvc/v2/bench/00112233445566ff/0of1/{digest}"


class Drain:
    """A subscriber reading every event batch the store publishes (a router's share of
    the work), on a thread of its own."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._sock.connect(endpoint)
        self.batches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                self._sock.recv_multipart()
                self.batches += 1
            except zmq.Again:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(0)
        self._ctx.term()


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def measure(cfg: dict[str, Any], obj_size: int, batch_bytes: int, rounds: int,
            tag: str) -> dict[str, float]:
    """Median put/get/memcpy GB/s for ``batch_bytes`` in objects of ``obj_size``."""
    n = batch_bytes // obj_size
    src = [np.random.default_rng(i).integers(0, 255, obj_size, dtype=np.uint8) for i in range(n)]
    dst = [np.ones(obj_size, np.uint8) for _ in range(n)]
    sizes = [obj_size] * n
    sp, dp = [a.ctypes.data for a in src], [a.ctypes.data for a in dst]
    put_t, get_t, cpy_t, slot_t, arena_t = [], [], [], [], []
    with open_store(cfg) as store:
        for r in range(rounds + 1):  # round 0 warms the arena pages
            keys = [block_key(tag, obj_size, r, i) for i in range(n)]
            cold()
            t0 = time.perf_counter()
            codes = store.batch_put_from(keys, sp, sizes)
            t1 = time.perf_counter()
            cold()
            t2 = time.perf_counter()
            got = store.batch_get_into(keys, dp, sizes)
            t3 = time.perf_counter()
            cold()
            t4 = time.perf_counter()
            for s, d in zip(src, dst):
                np.copyto(d, s)
            t5 = time.perf_counter()
            if codes != [OK] * n or got != sizes or not np.array_equal(dst[-1], src[-1]):
                raise RuntimeError(f"store round trip failed: {codes[:3]} {got[:3]}")
            whole, copy = slot_put(store, [block_key(tag, "slots", obj_size, r, i)
                                           for i in range(n)], sp, sizes)
            if r:
                put_t.append(t1 - t0)
                get_t.append(t3 - t2)
                cpy_t.append(t5 - t4)
                slot_t.append(whole)
                arena_t.append(copy)
    med = statistics.median
    return {"put_gbps": _gbps(batch_bytes, med(put_t)), "get_gbps": _gbps(batch_bytes, med(get_t)),
            "memcpy_gbps": _gbps(batch_bytes, med(cpy_t)),
            "slot_put_gbps": _gbps(batch_bytes, med(slot_t)),
            "arena_copy_gbps": _gbps(batch_bytes, med(arena_t))}


def slot_put(store: Any, keys: list[str], ptrs: list[int], sizes: list[int]
             ) -> tuple[float, float]:
    """A put the way the connectors write (``batch_alloc``, one memmove per slot,
    ``batch_commit``), caches evicted first: (seconds in all, seconds of the copies
    alone). The copies alone are what any put into this arena costs at least: the same
    bytes as the memcpy baseline, into store memory that rotates over the arena."""
    cold()
    t0 = time.perf_counter()
    slots = store.batch_alloc(keys, sizes)
    t1 = time.perf_counter()
    for slot, src in zip(slots, ptrs):
        ctypes.memmove(slot.ptr, src, slot.size)
    t2 = time.perf_counter()
    codes = store.batch_commit(slots)
    t3 = time.perf_counter()
    if codes != [OK] * len(keys):
        raise RuntimeError(f"slot put failed: {codes[:3]}")
    return t3 - t0, t2 - t1


def cross_process(cfg: dict[str, Any], obj_size: int, batch_bytes: int, rounds: int) -> dict:
    """Gets in a second process of objects this process put, with its own memcpy baseline."""
    n = batch_bytes // obj_size
    src = [np.random.default_rng(i).integers(0, 255, obj_size, dtype=np.uint8) for i in range(n)]
    keys = [block_key("xproc", obj_size, i) for i in range(n)]
    with open_store(cfg) as store:
        codes = store.batch_put_from(keys, [a.ctypes.data for a in src], [obj_size] * n)
        assert codes == [OK] * n, codes[:3]
        out = subprocess.run(
            module_command("benchmarks.micro.store", "--child",
                           json.dumps([cfg, obj_size, n, rounds])),
            capture_output=True, text=True, check=True, env=module_env())
    return json.loads(out.stdout)


def child(arg: str) -> None:
    cfg, obj_size, n, rounds = json.loads(arg)
    keys = [block_key("xproc", obj_size, i) for i in range(n)]
    dst = [np.ones(obj_size, np.uint8) for _ in range(n)]
    src = [np.random.default_rng(i).integers(0, 255, obj_size, dtype=np.uint8) for i in range(n)]
    dp, sizes = [a.ctypes.data for a in dst], [obj_size] * n
    get_t, put_t, cpy_t = [], [], []
    sp = [a.ctypes.data for a in src]
    with open_store(cfg) as store:
        for r in range(rounds + 1):
            cold()
            t0 = time.perf_counter()
            got = store.batch_get_into(keys, dp, sizes)
            t1 = time.perf_counter()
            cold()
            t2 = time.perf_counter()
            for s, d in zip(src, dst):
                np.copyto(d, s)
            t3 = time.perf_counter()
            cold()
            t4 = time.perf_counter()
            codes = store.batch_put_from([block_key(k, "child", r) for k in keys], sp, sizes)
            t5 = time.perf_counter()
            assert got == sizes and codes == [OK] * n, (got[:3], codes[:3])
            if r:
                get_t.append(t1 - t0)
                cpy_t.append(t3 - t2)
                put_t.append(t5 - t4)
    nbytes, med = n * obj_size, statistics.median
    print(json.dumps({"xproc_get_gbps": _gbps(nbytes, med(get_t)),
                      "xproc_put_gbps": _gbps(nbytes, med(put_t)),
                      "xproc_memcpy_gbps": _gbps(nbytes, med(cpy_t))}))


def run(args: argparse.Namespace) -> dict[str, Any]:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    batch = (16 if args.quick else 64) * MiB
    rounds = 3 if args.quick else 7
    cfg: dict[str, Any] = {"backend": args.backend, "name": name, "capacity_bytes": 4 * batch}
    if args.disk_dir is not None:
        cfg["disk"] = {"path": str(args.disk_dir), "capacity_bytes": 8 * batch}
    drain = None
    if args.events:
        from kvcentric.testing.servers import free_port

        cfg["events"] = {"endpoint": f"tcp://127.0.0.1:{free_port()}",
                         "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
        drain = Drain(cfg["events"]["endpoint"])
    sizes = [256 * KiB, 2 * MiB] if args.quick else [256 * KiB, 512 * KiB, 1 * MiB, 2 * MiB]
    rows = []
    try:
        for size in tqdm(sizes, desc="object sizes", disable=None):
            row: dict[str, Any] = {"object_bytes": size, "batch_bytes": batch}
            row |= measure(cfg, size, batch, rounds, "inproc")
            row |= cross_process(cfg, size, batch, rounds)
            rows.append(row)
    finally:
        from kvcentric.config import StoreConfig
        launcher.stop(StoreConfig.from_dict(cfg))
        if drain is not None:
            drain.close()
    med = statistics.median
    summary = {
        "put_vs_memcpy": med(r["put_gbps"] / r["memcpy_gbps"] for r in rows),
        "get_vs_memcpy": med(r["get_gbps"] / r["memcpy_gbps"] for r in rows),
        "xproc_get_vs_memcpy": med(r["xproc_get_gbps"] / r["xproc_memcpy_gbps"] for r in rows),
        "xproc_put_vs_memcpy": med(r["xproc_put_gbps"] / r["xproc_memcpy_gbps"] for r in rows),
        # the floor of a put: copying the same bytes into the arena's slots, without the
        # round trips; and how far the whole put is from it
        "arena_copy_vs_memcpy": med(r["arena_copy_gbps"] / r["memcpy_gbps"] for r in rows),
        "put_vs_arena_copy": med(r["put_gbps"] / r["arena_copy_gbps"] for r in rows),
        "slot_put_vs_memcpy": med(r["slot_put_gbps"] / r["memcpy_gbps"] for r in rows),
    }
    return {"benchmark": "store", "backend": args.backend, "quick": args.quick,
            "disk_tier": args.disk_dir is not None, "events": args.events,
            "event_batches_received": drain.batches if drain is not None else None,
            "cpus": os.cpu_count(), "rows": rows, "summary": summary}


def events_ab(args: argparse.Namespace, rounds: int) -> dict[str, Any]:
    """Alternate runs without and with KV events; per summary ratio, each side's median
    and range over the rounds, and with/without."""
    sides: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for _ in range(rounds):
        for side in ("off", "on"):
            args.events = side == "on"
            sides[side].append(run(args)["summary"])
    med = statistics.median
    out: dict[str, Any] = {}
    for k in sides["off"][0]:
        off = [s[k] for s in sides["off"]]
        on = [s[k] for s in sides["on"]]
        out[k] = {"off_median": med(off), "off_range": [min(off), max(off)],
                  "on_median": med(on), "on_range": [min(on), max(on)],
                  "on_over_off": med(on) / med(off),
                  "ranges_overlap": min(on) <= max(off) and min(off) <= max(on)}
    return {"benchmark": "store_events_ab", "backend": args.backend, "quick": args.quick,
            "rounds": rounds, "cpus": os.cpu_count(), "runs": sides, "summary": out}


def print_table(res: dict[str, Any]) -> None:
    print(f"\nstore benchmark, backend={res['backend']} (GB/s, median)")
    print(f"{'object':>8} {'put':>7} {'get':>7} {'memcpy':>7} {'xp put':>7} {'xp get':>7} "
          f"{'xp cpy':>7} {'slots':>7} {'arena':>7}")
    for r in res["rows"]:
        print(f"{r['object_bytes'] // KiB:>6}Ki {r['put_gbps']:7.2f} {r['get_gbps']:7.2f} "
              f"{r['memcpy_gbps']:7.2f} {r['xproc_put_gbps']:7.2f} {r['xproc_get_gbps']:7.2f} "
              f"{r['xproc_memcpy_gbps']:7.2f} {r['slot_put_gbps']:7.2f} "
              f"{r['arena_copy_gbps']:7.2f}")
    print("summary: " + ", ".join(f"{k}={v:.2f}" for k, v in res["summary"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["local", "mooncake"], default="local")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--disk-dir", type=Path, default=None,
                    help="give the local store a disk tier in this directory")
    ap.add_argument("--events", action="store_true",
                    help="turn on the store's KV events, with a subscriber draining them")
    ap.add_argument("--events-ab", type=int, default=0, metavar="N",
                    help="N rounds alternating runs without and with events")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.backend == "mooncake":  # ours vs the raw Mooncake client, see that module
        from benchmarks.micro.store_mooncake import main as mooncake_main

        mooncake_main((["--quick"] if args.quick else []) + (["--out", str(args.out)]
                      if args.out else []) + rest)
        return
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.child:
        child(args.child)
        return
    if args.events_ab:
        ab = events_ab(args, args.events_ab)
        for k, v in ab["summary"].items():
            print(f"{k}: off {v['off_median']:.3f} {v['off_range']}, on {v['on_median']:.3f} "
                  f"{v['on_range']}, on/off {v['on_over_off']:.3f}")
        out = args.out or RESULTS / f"store_events_ab{'_quick' if args.quick else ''}.json"
        rw.write(out, ab, command=rw.command_line(__file__))
        return
    res = run(args)
    print_table(res)
    tag = f"{args.backend}{'_disk' if args.disk_dir else ''}{'_quick' if args.quick else ''}"
    out = args.out or RESULTS / f"store_{tag}.json"
    rw.write(out, res, command=rw.command_line(__file__))


if __name__ == "__main__":
    main()
