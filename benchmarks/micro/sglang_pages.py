"""What does the integrity header cost the SGLang backend's one-segment (MLA) pages?

Before vs after, in one run on one local store. Before the header, a one-segment page
(MLA ``page_first``) *was* its object: ``batch_put_from`` / ``batch_get_into`` straight
on host-pool memory (the ``before`` arms below are exactly those two calls). Now every
object is ``[256-byte header][page]``, so the page goes through a slot (``batch_alloc``,
header, one memcpy, ``batch_commit``) and a lease (``batch_acquire``, header check, one
memcpy, ``release``): ``after`` runs the backend's ``page_io.save_pages`` /
``load_pages``. Both arms derive the store keys from SGLang's page hashes; ``after``
also the refs (one xxh3_128 per page).

Page geometries (MLA latent of 576 bf16 per token and layer): DeepSeek-V3 (61 layers)
at page sizes 64 and 1, DeepSeek-V2-Lite (27 layers) at 64, and the tests' tiny page
(3 layers of 32, 8 tokens: per-call costs only). Per round, a batch of pages (SGLang's
storage batch of 128, at most 64 MiB) is saved and loaded by each arm, arms taking turns
going first, CPU caches evicted before every timed call; the store (capacity 4x a
batch) recycles memory by eviction, and the rounds that wrap it once (touching every
arena page) are not timed. The tiny page also runs warm (no eviction, 4x the rounds): the
per-page cost of the header path alone. Reports median (and min) us per page and GB/s,
and after - before and after / before paired round by round.

    python -m benchmarks.micro.sglang_pages [--quick] [--out FILE.json]

writes ``benchmarks/results/sglang_pages.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS
from kvcentric.config import StoreConfig
from kvcentric.connector.sglang.page_io import load_pages, save_pages
from kvcentric.connector.sglang.pages import PageGeometry
from kvcentric.hashing import KeySpace
from kvcentric.integrity import HEADER_BYTES, ObjectHeaders
from kvcentric.store import OK, KVStore, open_store
from kvcentric.store.local import launcher
from kvcentric.stored_layout import KVLayout

MiB = 1 << 20
# name: (layers, page tokens, latent elements per token, bytes per element)
GEOMETRIES = {"deepseek-v3/page64": (61, 64, 576, 2), "deepseek-v2-lite/page64": (27, 64, 576, 2),
              "deepseek-v3/page1": (61, 1, 576, 2), "tests/page8": (3, 8, 32, 2)}
WARM_ROW = "tests/page8"  # also measured warm (no eviction, 4x the rounds): per-page costs
STORAGE_BATCH = 128  # pages per backup / prefetch call, SGLang's default
ARENA_BATCHES = 4  # store capacity, in batches of objects
WARM = ARENA_BATCHES // 2 + 1  # rounds (two batches each) that wrap the arena once
_SCRATCH = np.zeros(0, np.uint8)


def cold() -> None:
    """Evict CPU caches (write 64 MiB) so each timed call starts from memory."""
    global _SCRATCH
    if _SCRATCH.size == 0:
        _SCRATCH = np.empty(64 * MiB, np.uint8)
    _SCRATCH.fill((int(_SCRATCH[0]) + 1) % 256)


def geometry(layers: int, tokens: int, dim: int, elem: int) -> PageGeometry:
    """A one-segment MLA page geometry, as ``pages.page_geometry`` builds for a pool."""
    layout = KVLayout(num_layers=layers, block_size=tokens, num_kv_heads=1, head_dim=dim,
                      dtype="bfloat16" if elem == 2 else "float32", layout="sglang:page_first",
                      mla=True)
    ks = KeySpace("bench-sglang", layout.signature(), 0, 1)
    payload = layers * tokens * dim * elem
    return PageGeometry(layout, ks, tokens, (payload,), (HEADER_BYTES,), True,
                        ObjectHeaders(ks, payload))


def page_hashes(tag: str, n: int) -> list[str]:
    """SGLang's page keys: chained SHA-256 hex."""
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{tag}/{i}".encode()).digest()
        out.append(prev.hex())
    return out


def measure(store: KVStore, geo: PageGeometry, rounds: int, evict: bool = True
            ) -> dict[str, Any]:
    payload = geo.payload_bytes
    n = max(1, min(STORAGE_BATCH, (64 * MiB) // payload))
    src = np.random.default_rng(0).integers(0, 255, n * payload, dtype=np.uint8)
    dst = {arm: np.ones(n * payload, np.uint8) for arm in ("before", "after")}
    sp = [src.ctypes.data + i * payload for i in range(n)]
    dp = {arm: [a.ctypes.data + i * payload for i in range(n)] for arm, a in dst.items()}

    def before(r: int) -> tuple[float, float]:
        hashes = page_hashes(f"{uuid.uuid4()}/before/{r}", n)
        if evict:
            cold()
        t0 = time.perf_counter()
        keys = geo.keys(hashes)
        codes = store.batch_put_from(keys, sp, [payload] * n, geo.parents(keys, None))
        t1 = time.perf_counter()
        if evict:
            cold()
        t2 = time.perf_counter()
        got = store.batch_get_into(geo.keys(hashes), dp["before"], [payload] * n)
        t3 = time.perf_counter()
        assert codes == [OK] * n and got == [payload] * n, (codes[:3], got[:3])
        return t1 - t0, t3 - t2

    def after(r: int) -> tuple[float, float]:
        hashes = page_hashes(f"{uuid.uuid4()}/after/{r}", n)
        if evict:
            cold()
        t0 = time.perf_counter()
        keys, refs = geo.objects(hashes)
        ok = save_pages(store, geo, keys, refs, sp, geo.parents(keys, None))
        t1 = time.perf_counter()
        if evict:
            cold()
        t2 = time.perf_counter()
        loaded = load_pages(store, geo, *geo.objects(hashes), dp["after"], False)
        t3 = time.perf_counter()
        assert ok == [True] * n and loaded.ok == [True] * n, (ok[:3], loaded)
        return t1 - t0, t3 - t2

    arms: dict[str, Callable[[int], tuple[float, float]]] = {"before": before, "after": after}
    times: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    for r in range(WARM + rounds):  # the first WARM rounds touch every page of the arena
        order = ["before", "after"] if r % 2 else ["after", "before"]
        for arm in order:
            t = arms[arm](r)
            if r >= WARM:
                times[arm].append(t)
    assert np.array_equal(dst["before"], src) and np.array_equal(dst["after"], src)
    med = statistics.median
    row: dict[str, Any] = {"payload_bytes": payload, "object_bytes": geo.object_bytes,
                           "pages_per_batch": n}
    for arm, ts in times.items():
        for k, name in ((0, "set"), (1, "get")):
            row[f"{arm}_{name}_us_per_page"] = round(med(t[k] for t in ts) / n * 1e6, 2)
            row[f"{arm}_{name}_min_us_per_page"] = round(min(t[k] for t in ts) / n * 1e6, 2)
            row[f"{arm}_{name}_gbps"] = round(n * payload / med(t[k] for t in ts) / 1e9, 2)
    for k, name in ((0, "set"), (1, "get")):
        row[f"{name}_after_over_before"] = round(
            med(a[k] / b[k] for a, b in zip(times["after"], times["before"])), 3)
        row[f"{name}_extra_us_per_page"] = round(
            med(a[k] - b[k] for a, b in zip(times["after"], times["before"])) / n * 1e6, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of 25")
    ap.add_argument("--out", type=Path, default=RESULTS / "sglang_pages.json")
    args = ap.parse_args(argv)
    rounds = 3 if args.quick else 25
    rows = {}
    runs = [(name, dims, True) for name, dims in GEOMETRIES.items()]
    runs.append((f"{WARM_ROW} (warm)", GEOMETRIES[WARM_ROW], False))
    for name, dims, evict in runs:
        geo = geometry(*dims)
        batch = max(1, min(STORAGE_BATCH, (64 * MiB) // geo.payload_bytes))
        cfg = StoreConfig.from_dict({
            "name": f"bsg{uuid.uuid4().hex[:8]}",
            "capacity_bytes": max(16 * MiB, ARENA_BATCHES * batch * geo.object_bytes),
            "hot_timeout_s": 2.0})  # a busy box must not turn a batch into a miss
        try:
            with open_store(cfg) as store:
                rows[name] = measure(store, geo, rounds if evict else 4 * rounds, evict)
        finally:
            launcher.stop(cfg)
    lines = [f"{'page':<26} {'bytes':>9} {'pages':>5} | {'set us/page (median)':>30} | "
             f"{'get us/page (median)':>30}",
             f"{'':<26} {'':>9} {'':>5} | {'before':>8} {'after':>8} {'+us':>6} {'x':>5} | "
             f"{'before':>8} {'after':>8} {'+us':>6} {'x':>5}"]
    for name, r in rows.items():
        cols = [f"{r[f'before_{op}_us_per_page']:>8.1f} {r[f'after_{op}_us_per_page']:>8.1f} "
                f"{r[f'{op}_extra_us_per_page']:>6.1f} {r[f'{op}_after_over_before']:>5.2f}"
                for op in ("set", "get")]
        lines.append(f"{name:<26} {r['payload_bytes']:>9} {r['pages_per_batch']:>5} | "
                     f"{cols[0]} | {cols[1]}")
    lines.append("+us: after - before per page, x: after / before; both paired by round")
    doc = {"benchmark": "sglang_pages", "store": "local", "rounds": rounds, "rows": rows,
           "summary": {name: {"set": r["set_after_over_before"],
                              "get": r["get_after_over_before"]} for name, r in rows.items()}}
    rw.write(args.out, doc, table="\n".join(lines), command=rw.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
