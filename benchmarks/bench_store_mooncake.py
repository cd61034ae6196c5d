"""Mooncake backend vs the raw Mooncake client doing the same batch puts and gets, one run.

    python benchmarks/bench_store_mooncake.py [--quick] [--out FILE.json]
    python benchmarks/bench_store.py --backend mooncake [--quick]     (the same)

A real ``mooncake_master`` runs in a private network namespace (this process joins it).
Two placements, per object size:

- ``in_process``: the client contributes the only segment, so objects land in its own
  memory (Mooncake's local-copy path);
- ``cross_process``: the client is a pure client and a storage node in another process
  holds the segment (Mooncake's tcp transfer path).

Arms (each with its own registered source/destination buffers, taking turns going first
so both see the same machine noise): ``ours`` (``MooncakeStore.batch_put_from``,
which first asks which keys exist, and ``batch_get_into``), ``raw``
(``MooncakeDistributedStore.batch_put_from`` / ``batch_get_into``), the connector's paths
(``batch_alloc`` + ``batch_commit``, ``batch_acquire`` + ``release``), and raw Mooncake's
put-session/range API (``session``: start + one ranged put + end; ``session_layers``: one
ranged put per layer of 8, as layer-wise streaming would). Reports medians and ratios to
``raw``; CPU caches are evicted before every timed call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvcentric.store import OK, open_store  # noqa: E402
from kvcentric.store.mooncake import MooncakeStore  # noqa: E402
from kvcentric.store.mooncake_netns import NetNamespace  # noqa: E402
from kvcentric.store.mooncake_service import master_command, wait_master  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
RESULTS = Path(__file__).parent / "results"
MASTER = "127.0.0.1:50051"
LAYERS = 8
_SCRATCH = np.zeros(0, np.uint8)


def cold() -> None:
    """Evict CPU caches (write 64 MiB) so no arm profits from the previous one's cache."""
    global _SCRATCH
    if _SCRATCH.size == 0:
        _SCRATCH = np.empty(64 * MiB, np.uint8)
    _SCRATCH.fill(_SCRATCH[0] + 1)


def mooncake_cfg(segment: int) -> dict[str, Any]:
    return {"master_server_address": MASTER, "metadata_server": "P2PHANDSHAKE",
            "global_segment_size": segment, "local_buffer_size": 64 * MiB, "use_env": False,
            "staging_size": 160 * MiB, "preferred_segment": "local" if segment else ""}


def raw_client(segment: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    c = MooncakeDistributedStore()
    rc = c.setup("127.0.0.1", "P2PHANDSHAKE", segment, 64 * MiB, "tcp", "", MASTER)
    if rc != 0:
        raise RuntimeError(f"raw mooncake setup failed: {rc}")
    return c


def raw_config(client: Any, segment: int) -> Any:
    """The raw client's ReplicateConfig: its own segment first, as ours is configured."""
    from mooncake.store import ReplicateConfig

    rc = ReplicateConfig()
    if segment:
        rc.preferred_segment = client.get_hostname()
    return rc


class Batch:
    """``n`` objects of ``size`` bytes: registered sources, destinations back to back."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size
        self.src = np.random.default_rng(size).integers(0, 255, n * size, dtype=np.uint8)
        self.dst = np.ones(n * size, np.uint8)
        self.sp = [self.src.ctypes.data + i * size for i in range(n)]
        self.dp = [self.dst.ctypes.data + i * size for i in range(n)]
        self.sizes = [size] * n

    def register(self, register: Callable[[int, int], int]) -> None:
        for a in (self.src, self.dst):
            if register(a.ctypes.data, a.nbytes) != 0:
                raise RuntimeError("register_buffer failed")

    def check(self) -> None:
        if not np.array_equal(self.dst, self.src):
            raise RuntimeError("a round trip returned wrong bytes")
        self.dst.fill(1)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    cold()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def ours_round(store: MooncakeStore, b: Batch, tag: str) -> dict[str, float]:
    keys = [f"{tag}/{i}" for i in range(b.n)]
    t_put, codes = timed(lambda: store.batch_put_from(keys, b.sp, b.sizes))
    t_get, got = timed(lambda: store.batch_get_into(keys, b.dp, b.sizes))
    if codes != [OK] * b.n or got != b.sizes:
        raise RuntimeError(f"ours: put {codes[:3]} get {got[:3]}")
    b.check()
    store.clear()
    ckeys = [f"{tag}/c/{i}" for i in range(b.n)]

    def alloc_commit() -> list[int]:
        slots = store.batch_alloc(ckeys, b.sizes)
        return store.batch_commit([s for s in slots if s is not None])

    t_commit, codes = timed(alloc_commit)

    def acquire() -> int:
        lease = store.batch_acquire(ckeys, b.sizes)
        store.release(lease)
        return len(lease.keys)

    t_acq, n = timed(acquire)
    if codes != [OK] * b.n or n != b.n:
        raise RuntimeError(f"ours in place: commit {codes[:3]} acquired {n}")
    store.clear()
    return {"put": t_put, "get": t_get, "commit": t_commit, "acquire": t_acq}


def raw_round(client: Any, rc: Any, b: Batch, tag: str) -> dict[str, float]:
    keys = [f"{tag}/{i}" for i in range(b.n)]
    t_put, codes = timed(lambda: client.batch_put_from(keys, b.sp, b.sizes, rc))
    t_get, got = timed(lambda: client.batch_get_into(keys, b.dp, b.sizes))
    if list(codes) != [0] * b.n or list(got) != b.sizes:
        raise RuntimeError(f"raw: put {codes[:3]} get {got[:3]}")
    b.check()
    client.remove_all(True)
    out = {"put": t_put, "get": t_get}
    for name, parts in (("session", 1), ("session_layers", LAYERS)):
        skeys = [f"{tag}/{name}/{i}" for i in range(b.n)]
        chunk = b.size // parts

        def session(skeys: list[str] = skeys, parts: int = parts, chunk: int = chunk,
                    name: str = name) -> None:
            client.batch_put_session_start(skeys, b.sizes, rc)
            for p in range(parts):
                client.batch_put_from_multi_buffer_ranges(
                    skeys, [[sp + p * chunk] for sp in b.sp], [[chunk]] * b.n,
                    [[p * chunk]] * b.n)
            if list(client.batch_put_session_end(skeys)) != [0] * b.n:
                raise RuntimeError(f"raw {name} put failed")

        out[name], _ = timed(session)
        client.remove_all(True)
    return out


def placement(size: int, batch: int, rounds: int, cross: bool, bar: tqdm) -> dict[str, Any]:
    """Median GB/s per op and arm for one object size and placement.

    Both arms' clients live for all rounds. In process each contributes a segment and puts
    with its own segment preferred (ours: ``preferred_segment: local``; raw: the same
    ReplicateConfig), so objects are local copies. Round 0 is untimed (first touch of
    segment pages); then the arms take turns going first."""
    n = batch // size
    segment = 0 if cross else 3 * batch
    store = open_store({"backend": "mooncake", "mooncake": mooncake_cfg(segment)})
    assert isinstance(store, MooncakeStore)
    client = raw_client(segment)
    rc = raw_config(client, segment)
    b_ours, b_raw = Batch(n, size), Batch(n, size)
    b_ours.register(store.register_buffer)
    b_raw.register(client.register_buffer)
    _ = store.staging  # registered once, as an engine does at its first save
    times: dict[str, list[float]] = {}
    try:
        for r in range(rounds + 1):
            arms = [("ours", lambda r=r: ours_round(store, b_ours, f"o{r}")),
                    ("raw", lambda r=r: raw_round(client, rc, b_raw, f"r{r}"))]
            for arm, fn in (arms if r % 2 else arms[::-1]):
                for k, v in fn().items():
                    if r:
                        times.setdefault(f"{arm}_{k}", []).append(v)
            bar.update()
    finally:
        store.close()
        client.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"object_bytes": size, "batch_bytes": n * size, "placement":
            "cross_process" if cross else "in_process",
            **{f"{k}_gbps": n * size / v / 1e9 for k, v in med.items()}}


def start_cluster(ns: NetNamespace, logdir: Path) -> list[subprocess.Popen[Any]]:
    log = open(logdir / "bench-mooncake-master.log", "ab")
    master = subprocess.Popen(ns.wrap(master_command(metadata_port=0)), stdout=log, stderr=log,
                              start_new_session=True)
    wait_master("127.0.0.1", 50051, 9003, proc=master)
    return [master]


def start_node(ns: NetNamespace, segment: int, logdir: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "kvcentric.store.mooncake_service", "mooncake-node",
           "--segment", str(segment), "--master", MASTER, "--metadata", "P2PHANDSHAKE"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    log = open(logdir / "bench-mooncake-node.log", "ab")
    node = subprocess.Popen(ns.wrap(cmd), stdout=subprocess.PIPE, stderr=log, text=True,
                            env=env, start_new_session=True)
    assert node.stdout is not None
    if "ready" not in node.stdout.readline():
        raise RuntimeError("storage node failed to start")
    return node


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def ratio(place: str, arm: str, base: str = "raw_put_gbps") -> float:
        return statistics.median(r[arm] / r[base] for r in rows if r["placement"] == place)

    places = ("in_process", "cross_process")
    return {
        "put_vs_raw": {p: ratio(p, "ours_put_gbps") for p in places},
        "get_vs_raw": {p: ratio(p, "ours_get_gbps", "raw_get_gbps") for p in places},
        "commit_vs_raw_put": {p: ratio(p, "ours_commit_gbps") for p in places},
        "acquire_vs_raw_get": {p: ratio(p, "ours_acquire_gbps", "raw_get_gbps")
                               for p in places},
        "session_vs_put": {p: ratio(p, "raw_session_gbps") for p in places},
        "session_layers_vs_put": {p: ratio(p, "raw_session_layers_gbps") for p in places},
    }


def run(quick: bool, logdir: Path) -> dict[str, Any]:
    batch = (16 if quick else 64) * MiB
    rounds = 7 if quick else 15
    sizes = [256 * KiB, 2 * MiB] if quick else [256 * KiB, 512 * KiB, 1 * MiB, 2 * MiB]
    rows = []
    with NetNamespace() as ns, ns.entered():
        procs = start_cluster(ns, logdir)
        try:
            with tqdm(total=2 * len(sizes) * (rounds + 1), desc="mooncake rounds",
                      disable=None) as bar:
                for size in sizes:
                    rows.append(placement(size, batch, rounds, False, bar))
                procs.append(start_node(ns, 5 * batch, logdir))
                for size in sizes:
                    rows.append(placement(size, batch, rounds, True, bar))
        finally:
            for p in reversed(procs):
                p.terminate()
                p.wait(timeout=30)
    return {"benchmark": "store", "backend": "mooncake", "quick": quick,
            "cpus": os.cpu_count(), "rows": rows, "summary": summarise(rows)}


def print_table(res: dict[str, Any]) -> None:
    print("\nmooncake backend vs raw Mooncake client (GB/s, median)")
    cols = ["ours_put", "raw_put", "ours_get", "raw_get", "ours_commit", "ours_acquire",
            "raw_session", "raw_session_layers"]
    print(f"{'placement':>13} {'object':>7} " + " ".join(f"{c:>12}" for c in cols))
    for r in res["rows"]:
        print(f"{r['placement']:>13} {r['object_bytes'] // KiB:>5}Ki "
              + " ".join(f"{r[c + '_gbps']:12.2f}" for c in cols))
    for k, v in res["summary"].items():
        print(f"{k:>22}: " + ", ".join(f"{p}={x:.2f}" for p, x in v.items()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    res = run(args.quick, RESULTS / "logs")
    print_table(res)
    out = args.out or RESULTS / f"store_mooncake{'_quick' if args.quick else ''}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
