"""How fast do the block pack/unpack kernels move KV, next to torch's gather and copy?

Benchmark block pack/unpack (``kernels``) against torch baselines.

For Llama-8B / 70B style per-layer KV layouts it measures, in GB/s of KV
bytes moved:

* ``pack``   : ``pack_blocks_layers`` (blocks of every layer -> one row per block)
* ``unpack`` : ``unpack_blocks_layers`` (rows -> blocks)
* ``index_select`` / ``index_copy``: per-layer ``torch.index_select(out=)`` /
  ``index_copy_`` into/from a plain buffer (gather without re-layout);
* ``copy``   : ``dst.copy_(src)`` of an equally sized contiguous buffer.

On CUDA the layers use the flash layout ``[2, num_blocks, block_size,
kv_heads, head_dim]`` and both device->device and device->pinned-host rows are
measured (CUDA events); on CPU the vLLM CPU layout ``[num_blocks, kv_heads,
block_size, 2 * head_dim]`` runs the torch path (perf_counter medians) and
the output says so. ``--quick`` runs a small subset with 2 layers.

    python -m benchmarks.micro.kernels [--quick] [--out FILE.json]

Default output: benchmarks/results/kernels_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import ROOT
from kvcentric.kernels import (
    explain_impl,
    pack_blocks_layers,
    unpack_blocks_layers,
)

MODELS = {"llama-8b": (32, 8, 128), "llama-70b": (80, 8, 128)}  # layers, kv heads, head dim
BLOCK_SIZES = (16, 128, 256)
NUM_BLOCKS = (64, 256, 1024, 4096)
SUMMARY_MIN_BLOCK_BYTES = 64 * 1024
CPU_MAX_BYTES = 256 << 20  # packed bytes per case on CPU (shared, small machine)
QUICK_MAX_BYTES = 64 << 20
GPU_MAX_BYTES = 4 << 30


Row = dict[str, Any]  # one JSON result row


@dataclass(frozen=True)
class Case:
    """One measured configuration."""

    model: str
    block_size: int
    num_blocks: int
    num_layers: int
    target: str  # "device" or "pinned" (rows in pinned host memory)


def layer_shape(device: torch.device, blocks: int, block_size: int, heads: int, dim: int):
    """(shape, block_dim) of one KV layer in the device's native layout."""
    if device.type == "cuda":
        return (2, blocks, block_size, heads, dim), 1
    return (blocks, heads, block_size, 2 * dim), 0


def cases(device: torch.device, quick: bool) -> list[Case]:
    if quick:
        combos = [("llama-8b", 16, 64), ("llama-8b", 16, 1024), ("llama-8b", 128, 64)]
        combos += [("llama-70b", 256, 64)]
        layers = {"llama-8b": 2, "llama-70b": 2}
    else:
        combos = [(m, bs, nb) for m in MODELS for bs in BLOCK_SIZES for nb in NUM_BLOCKS]
        layers = (
            {m: MODELS[m][0] for m in MODELS} if device.type == "cuda" else dict.fromkeys(MODELS, 4)
        )
    targets = ["device", "pinned"] if device.type == "cuda" else ["device"]
    cap = GPU_MAX_BYTES if device.type == "cuda" else CPU_MAX_BYTES
    cap = min(cap, QUICK_MAX_BYTES) if quick else cap
    out: list[Case] = []
    for model, bs, nb in combos:
        _, heads, dim = MODELS[model]
        layer_count = layers[model]
        while layer_count > 1 and nb * layer_count * 4 * bs * heads * dim > cap:
            layer_count //= 2
        if nb * layer_count * 4 * bs * heads * dim <= cap:
            out.extend(Case(model, bs, nb, layer_count, t) for t in targets)
    return out


def timer(device: torch.device, repeats: int) -> Callable[[Callable[[], object]], float]:
    """Median seconds of ``fn()`` after one warm-up call."""

    def run(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return run


def measure(case: Case, device: torch.device, repeats: int) -> Row:
    """Time pack/unpack and the baselines for one case; returns one JSON row."""
    _, heads, dim = MODELS[case.model]
    pool = case.num_blocks + max(case.num_blocks // 4, 8)
    shape, bd = layer_shape(device, pool, case.block_size, heads, dim)
    gen = torch.Generator().manual_seed(0)
    layers = [
        torch.full(shape, k, dtype=torch.float16, device=device) for k in range(case.num_layers)
    ]
    ids = torch.randperm(pool, generator=gen)[: case.num_blocks]  # host ids, as from a scheduler
    ids_dev = ids.to(device)
    block_bytes = layers[0].select(bd, 0).numel() * 2
    nbytes = block_bytes * case.num_blocks * case.num_layers
    pinned = case.target == "pinned"
    rows = torch.empty(
        case.num_blocks,
        nbytes // case.num_blocks,
        dtype=torch.uint8,
        device="cpu" if pinned else device,
        pin_memory=pinned,
    )
    gathered = layers[0].index_select(bd, ids_dev)  # plain gather target, not packed layout
    plain = [torch.empty_like(gathered) for _ in layers]
    src_flat = torch.ones(nbytes, dtype=torch.uint8, device=device)  # touched: no zero page
    dst_flat = rows.view(-1)
    time_it = timer(device, repeats)
    seconds = {
        "pack": time_it(lambda: pack_blocks_layers(layers, ids, rows, block_dim=bd)),
        "unpack": time_it(lambda: unpack_blocks_layers(rows, ids, layers, block_dim=bd)),
        "index_select": time_it(lambda: _index_select_all(layers, bd, ids_dev, plain)),
        "index_copy": time_it(lambda: _index_copy_all(layers, bd, ids_dev, plain)),
        "copy": time_it(lambda: dst_flat.copy_(src_flat, non_blocking=pinned)),
    }
    impl = explain_impl(layers, ids, rows, block_dim=bd)
    row: Row = {
        "model": case.model,
        "layout": "flash" if bd == 1 else "cpu",
        "block_size": case.block_size,
        "num_blocks": case.num_blocks,
        "num_layers": case.num_layers,
        "target": case.target,
        "block_bytes": block_bytes,
        "bytes": nbytes,
        "impl": impl.name,
    }
    row.update({f"{k}_gbps": round(nbytes / s / 1e9, 3) for k, s in seconds.items()})
    return row


def _index_select_all(layers, bd, ids, plain) -> None:
    for layer, buf in zip(layers, plain, strict=True):
        torch.index_select(layer, bd, ids, out=buf)


def _index_copy_all(layers, bd, ids, plain) -> None:
    for layer, buf in zip(layers, plain, strict=True):
        layer.index_copy_(bd, ids, buf)


def summarize(rows: list[Row]) -> dict[str, float | None]:
    """Median ratios over rows whose per-layer block is at least 64 KiB."""
    big = [r for r in rows if r["block_bytes"] >= SUMMARY_MIN_BLOCK_BYTES]

    def ratio(a: str, b: str) -> float | None:
        vals = [r[a] / r[b] for r in big if r[b] > 0]
        return round(statistics.median(vals), 3) if vals else None

    return {
        "pack_vs_copy": ratio("pack_gbps", "copy_gbps"),
        "unpack_vs_copy": ratio("unpack_gbps", "copy_gbps"),
        "pack_vs_torch": ratio("pack_gbps", "index_select_gbps"),
        "unpack_vs_torch": ratio("unpack_gbps", "index_copy_gbps"),
    }


def progress(items: list[Case]) -> Iterable[Case]:
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc="bench_kernels", file=sys.stderr)


def print_table(rows: list[Row]) -> None:
    cols = [
        "model",
        "block_size",
        "num_blocks",
        "num_layers",
        "target",
        "impl",
        "pack_gbps",
        "unpack_gbps",
        "index_select_gbps",
        "index_copy_gbps",
        "copy_gbps",
    ]
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small subset, 2 layers")
    parser.add_argument("--out", type=Path, help="JSON path (default results/kernels_<dev>.json)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    todo = cases(device, args.quick)
    note = " (CPU: torch path; pinned-host rows need CUDA)" if device.type == "cpu" else ""
    print(f"device={device.type} cases={len(todo)} threads={torch.get_num_threads()}{note}")
    rows = [measure(case, device, args.repeats) for case in progress(todo)]
    impls = sorted({str(r["impl"]) for r in rows})
    impl = impls[0] if len(impls) == 1 else "mixed"
    print(f"impl={impl}")
    print_table(rows)
    result = {
        "benchmark": "kernels",
        "device": device.type,
        "impl": impl,
        "quick": args.quick,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "summary": summarize(rows),
    }
    print("summary:", json.dumps(result["summary"]))
    out = args.out or ROOT / "benchmarks" / "results" / f"kernels_{device.type}.json"
    rw.write(out, result, command=rw.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
