"""What does integrity cost per stored object: the header next to a payload checksum?

What end-to-end integrity costs per stored object: the header (always on) next to a
payload checksum (``verify_checksums``), on objects of the ``bench`` model's size.

Per object, the median of ``--reps`` rounds of ``--objects`` objects: writing a header
(a save), checking one (a load), and xxh3_64 over the payload (what a checksum costs on
each side). The header's cost is independent of the object size; a checksum reads every
byte. Also reports the totals for one 4096-token prompt (32 objects of 128 tokens).

    python -m benchmarks.micro.integrity [--out FILE.json]

writes ``benchmarks/results/integrity.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import ROOT
from kvcentric.hashing import KeySpace
from kvcentric.integrity import HEADER_BYTES, ObjectHeaders, ObjectRef
from kvcentric.store.base import checksum

# the bench model (8 layers, 4 KV heads of 64, bf16) at vLLM CPU's 128-token block
PAYLOAD = 8 * 128 * 4 * 64 * 2 * 2
PROMPT_OBJECTS = 4096 // 128


def per_object_us(fn: Callable[[int], Any], n: int, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        out.append((time.perf_counter() - t0) / n * 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/integrity.json")
    args = ap.parse_args(argv)
    headers = ObjectHeaders(KeySpace("bench", "0123456789abcdef"), PAYLOAD)
    mem = np.random.default_rng(0).integers(0, 256, args.objects * headers.object_bytes,
                                            dtype=np.uint8)
    base = mem.ctypes.data
    ptrs = [base + i * headers.object_bytes for i in range(args.objects)]
    refs = [ObjectRef(xxhash.xxh3_128_digest(str(i).encode()), i, 128)
            for i in range(args.objects)]
    runs = {
        "header_write": per_object_us(lambda i: headers.write(ptrs[i], refs[i]),
                                      args.objects, args.reps),
        "header_check": per_object_us(lambda i: headers.check(ptrs[i], refs[i]),
                                      args.objects, args.reps),
        "payload_checksum": per_object_us(
            lambda i: checksum(ptrs[i] + HEADER_BYTES, PAYLOAD), args.objects, args.reps),
    }
    assert all(headers.check(p, r) for p, r in zip(ptrs, refs))
    med = {k: statistics.median(v) for k, v in runs.items()}
    rows = {k: {"median_us": round(med[k], 3), "runs_us": [round(x, 3) for x in v],
                "per_4k_prompt_ms": round(med[k] * PROMPT_OBJECTS / 1e3, 4)}
            for k, v in runs.items()}
    lines = [f"object: {HEADER_BYTES} B header + {PAYLOAD} B payload; "
             f"{PROMPT_OBJECTS} objects per 4k prompt",
             f"{'cost':<18} {'us/object':>10} {'ms/4k prompt':>13}"]
    lines += [f"{k:<18} {r['median_us']:>10.2f} {r['per_4k_prompt_ms']:>13.3f}"
              for k, r in rows.items()]
    doc = {"benchmark": "integrity", "object_bytes": headers.object_bytes,
           "payload_bytes": PAYLOAD, "rows": rows,
           "summary": {"header_check_us": rows["header_check"]["median_us"],
                       "header_write_us": rows["header_write"]["median_us"],
                       "checksum_us": rows["payload_checksum"]["median_us"],
                       "checksum_over_header_check": round(
                           med["payload_checksum"] / med["header_check"], 1)}}
    rw.write(args.out, doc, table="\n".join(lines), command=rw.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
