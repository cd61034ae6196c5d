"""How close does the CUDA path (HBM <-> pinned store memory) come to its bandwidth floor?

Per vLLM GPU layout (FlashAttention ``[2, num_blocks, 16, 8, 128]``, FlashInfer
``[num_blocks, 2, 16, 8, 128]``, MLA ``[num_blocks, 64, 576]``; bf16, Llama-8B-like: 32
layers) it drives the real ``KVCentricWorker`` on a real local store whose arena is
registered with CUDA, and measures in the same run:

* ``save`` / ``load``: GB/s of one step saving / loading N objects (every layer) through
  the worker (slots, packs on the copy stream, commit; leases, unpacks, waits);
* ``pinned_copy``: one contiguous ``copy_`` of the same bytes between HBM and pinned host
  memory, each direction (what the page gather/scatter is compared with);
* ``floor``: the best contiguous pinned copy of 1 GiB each way (the PCIe / C2C floor);
* ``kernels``: one layer's pages of the step between the cache and object-like pinned
  rows: staged (gather in HBM, one DMA per object; what the worker runs, ``picked`` is its
  measured device-side gather) against Triton, per-page DMA and torch page by page;
* ``overlap``: a forward stand-in (matmuls per layer, waiting for each layer's load as
  vLLM does) with and without a step's loads running under it.

Summary keys: ``<layout>_save_vs_pinned_copy``, ``<layout>_load_vs_pinned_copy``,
``overlap_slowdown`` (forward time with loads / without - 1). Needs CUDA; on a machine
without it, says so and exits 2.

    python -m benchmarks.micro.gpu_path [--quick] [--out FILE.json]

Default output: benchmarks/results/gpu_<device>.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash
from tqdm import tqdm

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import ROOT
from benchmarks.lib.workers import worker_on
from kvcentric.config import StoreConfig
from kvcentric.connector.vllm.engine_layout import EngineLayout
from kvcentric.connector.vllm.mover import ObjectGeometry
from kvcentric.connector.vllm.transfers import StepPlan, TransferSpec
from kvcentric.hashing import KeySpace
from kvcentric.integrity import ObjectRef
from kvcentric.kernels import explain_impl, pack_blocks, unpack_blocks
from kvcentric.kernels.staged import staged_pack, staged_unpack
from kvcentric.store import open_store
from kvcentric.store.local import launcher
from kvcentric.stored_layout import KVLayout

H, D = 8, 128
LAYOUTS: dict[str, tuple[Callable[[int], tuple[int, ...]], int, int]] = {
    # name -> (layer shape for nb blocks, block dim, page tokens)
    "flash_attn": (lambda nb: (2, nb, 16, H, D), 1, 16),
    "flashinfer": (lambda nb: (nb, 2, 16, H, D), 0, 16),
    "mla": (lambda nb: (nb, 64, 576), 0, 64),
}
OBJECT_TOKENS = 256


class Case:
    """One layout's caches, two workers (saver, loader) and the objects of one step."""

    def __init__(self, name: str, layers: int, objects: int, cfg: StoreConfig) -> None:
        shape_fn, self.block_dim, page = LAYOUTS[name]
        k = OBJECT_TOKENS // page
        nb = objects * k + 8
        shape = shape_fn(nb)
        page_bytes = torch.Size(shape).numel() // nb * 2
        mla = name == "mla"
        kv = KVLayout(num_layers=layers, block_size=OBJECT_TOKENS, num_kv_heads=1 if mla else H,
                      head_dim=576 if mla else D, dtype="bfloat16", layout=f"bench:{name}",
                      mla=mla)
        self.engine = EngineLayout(kv, ObjectGeometry(layers, k, page_bytes),
                                   KeySpace("bench-gpu", kv.signature()), page)
        self.src = {f"l{i}": torch.randn(shape, dtype=torch.bfloat16, device="cuda")
                    for i in range(layers)}
        self.dst = {n: torch.zeros_like(t) for n, t in self.src.items()}
        self.pages = [[i * k + j for j in range(k)] for i in range(objects)]
        self.nbytes = objects * self.engine.geometry.object_bytes
        self.cfg = cfg
        self.saver = worker_on(cfg, self.engine, self.src)
        self.loader = worker_on(cfg, self.engine, self.dst)

    def refs(self, tag: str) -> list[ObjectRef]:
        return [ObjectRef(xxhash.xxh3_128_digest(f"{tag}-{i}".encode()), i, OBJECT_TOKENS)
                for i in range(len(self.pages))]

    def keys(self, tag: str) -> list[str]:
        return [r.key(self.engine.keyspace) for r in self.refs(tag)]

    def save(self, tag: str) -> float:
        refs = self.refs(tag)
        plan = StepPlan(saves=[TransferSpec(tag, refs, self.pages, [None] * len(refs))],
                        commit_now=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.saver.plan_saves(plan)
        for name, layer in self.src.items():
            self.saver.save_layer(name, layer)
        self.saver.finish_step()
        return time.perf_counter() - t0

    def load(self, tag: str, forward: Callable[[], None] | None = None) -> float:
        plan = StepPlan(loads=[TransferSpec(tag, self.refs(tag), self.pages)] if tag else [])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.loader.start_load(plan)
        for name in self.dst:
            self.loader.wait_for_layer(name)
            if forward is not None:
                forward()
        self.loader.finish_step()
        torch.cuda.synchronize()
        assert not self.loader.take_load_errors(), "a load failed"
        return time.perf_counter() - t0

    def close(self) -> None:
        self.saver.close()
        self.loader.close()


def best_copy(nbytes: int, repeats: int) -> dict[str, float]:
    """Best GB/s of one contiguous copy of ``nbytes`` HBM -> pinned and pinned -> HBM."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[name] = nbytes / min(times) / 1e9
    return out


def kernels(case: Case, repeats: int) -> dict[str, dict[str, float]]:
    """GB/s of moving one layer's pages of the step between the cache and object-like
    pinned host rows (``[objects, k * page_bytes]``, strided like objects in the arena):
    ``staged`` (gather in HBM, one DMA per object: what the worker runs) against each
    impl copying across PCIe page by page (``direct-<impl>``: k calls per layer)."""
    layer = case.src["l0"]
    g, k = len(case.pages), len(case.pages[0])
    page_bytes = case.engine.geometry.page_bytes
    buf = torch.empty((g, 2 * k * page_bytes), dtype=torch.uint8, pin_memory=True)
    host = buf[:, : k * page_bytes]
    flat = torch.tensor([p for ps in case.pages for p in ps]).pin_memory()
    by_page = flat.view(g, k).t().contiguous()
    pages = host.view(g, k, page_bytes)
    nbytes = g * k * page_bytes
    moves: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {"staged": (
        lambda: staged_pack(layer, flat, host, block_dim=case.block_dim),
        lambda: staged_unpack(host, flat, layer, block_dim=case.block_dim))}
    if "triton" in candidates(layer, flat[:1].cuda(), pages[:1, 0].cuda(), case.block_dim):
        moves["staged-triton"] = (  # the validating generic kernel on the HBM side
            lambda: staged_pack(layer, flat, host, block_dim=case.block_dim, impl="triton"),
            lambda: staged_unpack(host, flat, layer, block_dim=case.block_dim, impl="triton"))

    def direct(i: str) -> tuple[Callable[[], object], Callable[[], object]]:
        return (lambda: [pack_blocks(layer, by_page[j], pages[:, j], block_dim=case.block_dim,
                                     impl=i) for j in range(k)],
                lambda: [unpack_blocks(pages[:, j], by_page[j], layer, block_dim=case.block_dim,
                                       impl=i) for j in range(k)])

    for impl in candidates(layer, by_page[0], pages[:, 0], case.block_dim):
        moves[f"direct-{impl}"] = direct(impl)
    out: dict[str, dict[str, float]] = {"pack": {}, "unpack": {}}
    for name, (pack, unpack) in moves.items():
        out["pack"][name] = round(nbytes / _best(pack, repeats) / 1e9, 2)
        out["unpack"][name] = round(nbytes / _best(unpack, repeats) / 1e9, 2)
    return out


def candidates(layer: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
               block_dim: int) -> list[str]:
    """The impls that really run for these arguments (not a torch fallback)."""
    out: list[str] = []
    for impl in ("triton", "dma", "torch"):
        try:
            if explain_impl(layer, ids, rows, block_dim=block_dim, impl=impl).name == impl:
                out.append(impl)
        except ValueError:  # e.g. triton without CUDA or the interpreter
            continue
    return out


def _best(fn: Callable[[], object], repeats: int) -> float:
    """Best seconds of ``fn`` (device synchronised around it), after one warm-up."""
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def measure(case: Case, repeats: int) -> dict[str, Any]:
    saves, loads = [], []
    for r in range(repeats):
        saves.append(case.save(f"r{r}"))
        loads.append(case.load(f"r{r}"))
        if r:  # keep one step's objects for the overlap run; free the rest
            with open_store(case.cfg) as st:
                for key in case.keys(f"r{r}"):
                    st.remove(key, force=True)
    pinned = best_copy(case.nbytes, repeats)
    path = case.saver._path.kernel
    return {"bytes": case.nbytes, "save_gbps": round(case.nbytes / min(saves) / 1e9, 2),
            "load_gbps": round(case.nbytes / min(loads) / 1e9, 2),
            "pinned_copy_gbps": {k: round(v, 2) for k, v in pinned.items()},
            "picked": {"pack": path.pack_impl, "unpack": path.unpack_impl},
            "kernels_gbps": kernels(case, repeats)}


def overlap(case: Case, matmuls: int, repeats: int) -> dict[str, float]:
    """Forward stand-in time without and with the first step's loads under it."""
    x = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")

    def forward() -> None:
        for _ in range(matmuls):
            torch.mm(x, x)

    alone = statistics.median(case.load("", forward) for _ in range(repeats))
    loaded = statistics.median(case.load("r0", forward) for _ in range(repeats))
    load_only = statistics.median(case.load("r0") for _ in range(repeats))
    return {"forward_s": alone, "forward_with_loads_s": loaded, "loads_alone_s": load_only,
            "slowdown": loaded / alone - 1}


def runtime_dir(need: int) -> Path:
    """A tmpfs directory with room for the store arena, else a temporary directory."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > need * 1.2:
        return Path(tempfile.mkdtemp(prefix="kvc-gpu-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="kvc-gpu-"))


def bars(results: dict[str, Any], floor: dict[str, float], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    series = {"save": [results[n]["save_gbps"] for n in names],
              "load": [results[n]["load_gbps"] for n in names],
              "pinned copy d2h": [results[n]["pinned_copy_gbps"]["d2h"] for n in names],
              "pinned copy h2d": [results[n]["pinned_copy_gbps"]["h2d"] for n in names]}
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(series)
    for i, (label, vals) in enumerate(series.items()):
        ax.bar([j + i * width for j in range(len(names))], vals, width, label=label)
    ax.axhline(max(floor.values()), color="k", ls="--", lw=1, label="floor (1 GiB copy)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def table(results: dict[str, Any], floor: dict[str, float], ov: dict[str, float]) -> str:
    lines = [f"floor: d2h {floor['d2h']:.1f} GB/s, h2d {floor['h2d']:.1f} GB/s",
             f"{'layout':<11} {'save':>7} {'load':>7} {'copy d2h':>9} {'copy h2d':>9}  picked"]
    for name, r in results.items():
        c = r["pinned_copy_gbps"]
        lines.append(f"{name:<11} {r['save_gbps']:>7.1f} {r['load_gbps']:>7.1f} "
                     f"{c['d2h']:>9.1f} {c['h2d']:>9.1f}  {r['picked']}")
    lines.append(f"overlap: forward {ov['forward_s'] * 1e3:.1f} ms alone, "
                 f"{ov['forward_with_loads_s'] * 1e3:.1f} ms with loads "
                 f"({ov['slowdown']:+.1%}); loads alone {ov['loads_alone_s'] * 1e3:.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 layers, 4 objects, 3 repeats")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--objects", type=int, default=16, help="objects per step (256 tokens)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--matmuls", type=int, default=8, help="4096^2 matmuls per layer")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu_path needs a CUDA device (torch sees none); nothing measured",
              file=sys.stderr)
        return 2
    if args.quick:
        args.layers, args.objects, args.repeats = 8, 4, 3
    device = torch.cuda.get_device_name(0)
    out = args.out or ROOT / "benchmarks/results" / f"gpu_{device.split()[-1].lower()}.json"
    results: dict[str, Any] = {}
    ov: dict[str, float] = {}
    for name in tqdm(LAYOUTS, desc="layouts"):
        # room for two steps' objects (the kept one and the one in flight), with slack;
        # MLA objects are smaller than the MHA ones this bounds
        need = 4 * args.objects * OBJECT_TOKENS * args.layers * 2 * H * D * 2
        cfg = StoreConfig.from_dict({"name": f"gpu-{name}", "capacity_bytes": need,
                                     "runtime_dir": runtime_dir(need), "op_timeout_s": 30.0})
        case = Case(name, args.layers, args.objects, cfg)
        try:
            results[name] = measure(case, args.repeats)
            if name == "flash_attn":
                ov = overlap(case, args.matmuls, args.repeats)
        finally:
            case.close()
            launcher.stop(cfg)
            shutil.rmtree(cfg.local.runtime_dir, ignore_errors=True)
    floor = best_copy(1 << 30, args.repeats)
    summary: dict[str, float] = {"overlap_slowdown": round(ov["slowdown"], 4)}
    for name, r in results.items():
        c = r["pinned_copy_gbps"]
        summary[f"{name}_save_vs_pinned_copy"] = round(r["save_gbps"] / c["d2h"], 3)
        summary[f"{name}_load_vs_pinned_copy"] = round(r["load_gbps"] / c["h2d"], 3)
    doc = {"device": device, "config": vars(args) | {"out": str(out)}, "summary": summary,
           "floor_gbps": floor, "layouts": results, "overlap": ov}
    rw.write(out, doc, table=table(results, floor, ov),
             figures=[rw.Figure("bandwidth", f"HBM <-> pinned store, {device}",
                                lambda p: bars(results, floor, p))],
             command=rw.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
