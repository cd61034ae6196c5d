"""Is our Mooncake backend as fast as the raw Mooncake client doing the same puts and gets?

Mooncake backend vs the raw Mooncake client doing the same batch puts and gets, one run.

    python -m benchmarks.micro.store_mooncake [--quick] [--out FILE.json]
    python -m benchmarks.micro.store --backend mooncake [--quick]     (the same)

A real ``mooncake_master`` runs in a private network namespace (this process joins it).
Two placements, per object size:

- ``in_process``: the client contributes the only segment, so objects land in its own
  memory (Mooncake's local-copy path);
- ``cross_process``: the client is a pure client and a storage node in another process
  holds the segment (Mooncake's tcp transfer path).

Arms (each with its own registered source/destination buffers, taking turns going first
so both see the same machine noise): ``ours`` (``MooncakeStore.batch_put_from``,
which first asks which keys exist, and ``batch_get_into``, with the backend's default
``verify_checksums``: on, an xxh3 trailer written with every put and checked on every
get), ``ours_nosum`` (the same calls with ``verify_checksums`` off: what the checksums
cost), ``raw``
(``MooncakeDistributedStore.batch_put_from`` / ``batch_get_into``), the connector's paths
(``batch_alloc`` + ``batch_commit``, ``batch_acquire`` + ``release``), scatter/gather
(``batch_put_from_multi`` / ``batch_get_into_multi``: each object from/into 16 page
buffers, as a zero-copy connector would move KV pages), and raw Mooncake's
put-session/range API (``session``: start + one ranged put + end; ``session_layers``: one
ranged put per layer of 8, as layer-wise streaming would). Reports median GB/s, and ratios
to ``raw`` paired round by round (the arms run back to back, so a drifting machine load
hits both); CPU caches are evicted before every timed call.
"""

from __future__ import annotations

import argparse
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

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS, module_env
from kvcentric.store import OK, open_store
from kvcentric.store.mooncake.service import master_command, wait_master
from kvcentric.store.mooncake.store import MooncakeStore
from kvcentric.testing.netns import NetNamespace

KiB, MiB = 1 << 10, 1 << 20
MASTER = "127.0.0.1:50051"
LAYERS = 8
# (arm, baseline) pairs compared round by round
PAIRS = [("ours_put", "raw_put"), ("ours_get", "raw_get"),
         ("ours_nosum_put", "raw_put"), ("ours_nosum_get", "raw_get"),
         ("ours_commit", "raw_put"),
         ("ours_acquire", "raw_get"), ("ours_put_pages", "raw_put"),
         ("ours_get_pages", "raw_get"), ("raw_session", "raw_put"),
         ("raw_session_layers", "raw_put")]
_SCRATCH = np.zeros(0, np.uint8)


def cold() -> None:
    """Evict CPU caches (write 64 MiB) so no arm profits from the previous one's cache."""
    global _SCRATCH
    if _SCRATCH.size == 0:
        _SCRATCH = np.empty(64 * MiB, np.uint8)
    _SCRATCH.fill((int(_SCRATCH[0]) + 1) % 256)


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


def put_get_round(store: MooncakeStore, b: Batch, tag: str) -> dict[str, float]:
    """``batch_put_from`` then ``batch_get_into`` of the batch (checked, then cleared)."""
    keys = [f"{tag}/{i}" for i in range(b.n)]
    t_put, codes = timed(lambda: store.batch_put_from(keys, b.sp, b.sizes))
    t_get, got = timed(lambda: store.batch_get_into(keys, b.dp, b.sizes))
    if codes != [OK] * b.n or got != b.sizes:
        raise RuntimeError(f"{tag}: put {codes[:3]} get {got[:3]}")
    b.check()
    store.clear()
    return {"put": t_put, "get": t_get}


def ours_round(store: MooncakeStore, b: Batch, tag: str) -> dict[str, float]:
    out = put_get_round(store, b, tag)
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
    return {**out, "commit": t_commit, "acquire": t_acq, **pages_round(store, b, tag)}


def pages_round(store: MooncakeStore, b: Batch, tag: str) -> dict[str, float]:
    """Scatter/gather: each object from/into ``2 * LAYERS`` page buffers, as a connector
    moving pages straight between a registered paged KV cache and the store would."""
    k = 2 * LAYERS
    page = b.size // k
    src = [[p + j * page for j in range(k)] for p in b.sp]
    dst = [[p + j * page for j in range(k)] for p in b.dp]
    keys = [f"{tag}/m/{i}" for i in range(b.n)]
    t_put, codes = timed(lambda: store.batch_put_from_multi(keys, src, [[page] * k] * b.n))
    t_get, got = timed(lambda: store.batch_get_into_multi(keys, dst, [[page] * k] * b.n))
    store.clear()
    if codes != [OK] * b.n or got != b.sizes:
        # seen over tcp with thousands of small slices per batch: TRANSFER_FAIL (-800)
        b.dst.fill(1)
        return {"pages_failures": 1.0}
    b.check()
    return {"put_pages": t_put, "get_pages": t_get}


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
    assert isinstance(store, MooncakeStore) and store.cfg.verify_checksums
    nosum = open_store({"backend": "mooncake", "verify_checksums": False,
                        "mooncake": mooncake_cfg(segment)})
    assert isinstance(nosum, MooncakeStore)
    client = raw_client(segment)
    rc = raw_config(client, segment)
    b_ours, b_nosum, b_raw = Batch(n, size), Batch(n, size), Batch(n, size)
    b_ours.register(store.register_buffer)
    b_nosum.register(nosum.register_buffer)
    b_raw.register(client.register_buffer)
    _ = store.ops.staging  # registered once, as an engine does at its first save
    times: dict[str, list[float | None]] = {}
    try:
        for r in range(rounds + 1):
            arms = [("ours", lambda r=r: ours_round(store, b_ours, f"o{r}")),
                    ("ours_nosum", lambda r=r: put_get_round(nosum, b_nosum, f"n{r}")),
                    ("raw", lambda r=r: raw_round(client, rc, b_raw, f"r{r}"))]
            got: dict[str, float] = {}
            for arm, fn in (arms if r % 2 else arms[::-1]):
                got |= {f"{arm}_{k}": v for k, v in fn().items()}
            for k in set(times) | set(got) if r else ():
                times.setdefault(k, [None] * (r - 1)).append(got.get(k))
            bar.update()
    finally:
        store.close()
        nosum.close()
        client.close()
    return {"object_bytes": size, "batch_bytes": n * size, "placement":
            "cross_process" if cross else "in_process", **gbps(times, n * size),
            "failures": {k: sum(v for v in vs if v) for k, vs in times.items()
                         if k.endswith("_failures")},
            "paired": paired(times)}


def gbps(times: dict[str, list[float | None]], nbytes: int) -> dict[str, float | None]:
    """Median GB/s per op over the rounds it succeeded in (None: never)."""
    out: dict[str, float | None] = {}
    for k, vs in times.items():
        ok = [v for v in vs if v]
        if not k.endswith("_failures"):
            out[f"{k}_gbps"] = nbytes / statistics.median(ok) / 1e9 if ok else None
    return out


def paired(times: dict[str, list[float | None]]) -> dict[str, float | None]:
    """Ratios paired by round (both arms ran back to back): robust to drifting load."""
    out: dict[str, float | None] = {}
    for name, base in PAIRS:
        pairs = [b / a for a, b in zip(times.get(name, []), times.get(base, [])) if a and b]
        out[f"{name}_vs_{base}"] = statistics.median(pairs) if pairs else None
    return out


def start_cluster(ns: NetNamespace, logdir: Path, prefix: str = "bench-mooncake"
                  ) -> list[subprocess.Popen[Any]]:
    """``mooncake_master`` on the default ports in ``ns``, logging to ``{prefix}-master.log``."""
    log = open(logdir / f"{prefix}-master.log", "ab")
    master = subprocess.Popen(ns.wrap(master_command(metadata_port=0)), stdout=log, stderr=log,
                              start_new_session=True)
    wait_master("127.0.0.1", 50051, 9003, proc=master)
    return [master]


def start_node(ns: NetNamespace, segment: int | str, logdir: Path,
               prefix: str = "bench-mooncake") -> subprocess.Popen[str]:
    """A storage node lending ``segment`` (bytes or e.g. ``"2gb"``); returns once mounted."""
    cmd = [sys.executable, "-m", "kvcentric.store.mooncake.service", "mooncake-node",
           "--segment", str(segment), "--master", MASTER, "--metadata", "P2PHANDSHAKE"]
    env = module_env()
    log_path = logdir / f"{prefix}-node.log"
    node = subprocess.Popen(ns.wrap(cmd), stdout=subprocess.PIPE, stderr=open(log_path, "ab"),
                            text=True, env=env, start_new_session=True)
    assert node.stdout is not None
    if "ready" not in node.stdout.readline():
        node.kill()
        node.wait()
        raise RuntimeError(f"storage node failed to start; see {log_path}")
    return node


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per ratio and placement: the median over object sizes of the round-paired ratios."""
    names = {"ours_put_vs_raw_put": "put_vs_raw", "ours_get_vs_raw_get": "get_vs_raw",
             "ours_nosum_put_vs_raw_put": "nosum_put_vs_raw",
             "ours_nosum_get_vs_raw_get": "nosum_get_vs_raw",
             "ours_commit_vs_raw_put": "commit_vs_raw_put",
             "ours_acquire_vs_raw_get": "acquire_vs_raw_get",
             "ours_put_pages_vs_raw_put": "put_pages_vs_raw_put",
             "ours_get_pages_vs_raw_get": "get_pages_vs_raw_get",
             "raw_session_vs_raw_put": "session_vs_put",
             "raw_session_layers_vs_raw_put": "session_layers_vs_put"}
    def med(key: str, place: str) -> float | None:
        vals = [r["paired"][key] for r in rows
                if r["placement"] == place and r["paired"][key] is not None]
        return statistics.median(vals) if vals else None

    return {short: {place: med(key, place) for place in ("in_process", "cross_process")}
            for key, short in names.items()}


def run(quick: bool, logdir: Path) -> dict[str, Any]:
    batch = (16 if quick else 64) * MiB
    rounds = 9 if quick else 21
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


COLUMNS = {"ours_put": "put", "raw_put": "raw put", "ours_get": "get", "raw_get": "raw get",
           "ours_nosum_put": "put -sum", "ours_nosum_get": "get -sum",
           "ours_commit": "commit", "ours_acquire": "acquire", "ours_put_pages": "put pg",
           "ours_get_pages": "get pg", "raw_session": "sess", "raw_session_layers": "sess/L"}


def print_table(res: dict[str, Any]) -> None:
    print("\nmooncake backend (ours) vs raw Mooncake client, GB/s, median "
          "(pg: 16 page buffers per object; sess: raw put session, /L: one range per layer)")
    print(f"{'placement':>13} {'object':>7} " + " ".join(f"{c:>8}" for c in COLUMNS.values()))
    for r in res["rows"]:
        print(f"{r['placement']:>13} {r['object_bytes'] // KiB:>5}Ki "
              + " ".join(_fmt(r.get(c + "_gbps"), 8) for c in COLUMNS))
    for k, v in res["summary"].items():
        print(f"{k:>22}: " + ", ".join(f"{p}={_fmt(x, 0)}" for p, x in v.items()))
    for r in res["rows"]:
        if any(r["failures"].values()):
            print(f"failed rounds, {r['placement']} {r['object_bytes'] // KiB} KiB: "
                  f"{r['failures']}")


def _fmt(x: float | None, width: int) -> str:
    return f"{x:{width}.2f}" if x is not None else f"{'-':>{width}}"


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["summary"])
    fig, ax = plt.subplots(figsize=(10, 4))
    for j, place in enumerate(("in_process", "cross_process")):
        ax.bar([i + 0.4 * j - 0.2 for i in range(len(names))],
               [res["summary"][n][place] or 0.0 for n in names], 0.4, label=place)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(0.9, color="red", lw=0.8, ls="--", label="0.9x target")
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set(ylabel="ratio to raw Mooncake (median)", title="mooncake backend vs raw client")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    res = run(args.quick, RESULTS / "logs")
    print_table(res)
    out = args.out or RESULTS / f"store_mooncake{'_quick' if args.quick else ''}.json"
    rw.write(out, res, command=rw.command_line(__file__, argv))
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
