"""What does one step of the vLLM worker cost the host, next to the copy it makes?

    python -m benchmarks.micro.worker_step [--quick] [--steps 200] [--out FILE.json]

Drives the real ``KVCentricWorker`` on a real local store, on CPU tensors laid out as vLLM
CPU lays out its KV cache (``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` per
layer, 32 layers), as vLLM's model runner does: a save step (``plan_saves``, one
``save_layer`` per layer, ``finish_step``) and a load step (``start_load``, one
``wait_for_layer`` per layer, ``finish_step``) of the same objects, alternately. Per case,
medians over the steps:

- ``save_cpu_ms`` / ``load_cpu_ms``: CPU time of the process per step (every thread: the
  copies run on the worker's copy threads), and the wall time;
- ``copy_cpu_ms``: the floor, in the same run: the same pages of every layer gathered by
  one ``index_select`` per layer into a buffer of the step's bytes.

Cases: ``page128`` (128-token pages and objects, what the connector uses on vLLM CPU: one
page an object), ``page16`` (16-token pages in 256-token objects, as on GPUs: sixteen
pages an object), each with 1 and 8 objects a step; heads are few so a step's bytes are
small and its fixed host cost shows (the issue's "per-step host cost"). The store's
round trips (reserve, commit, acquire) are in the steps; the copy floor has none. Torch
runs one intra-op thread (the copies are small; idle OpenMP threads spinning on a shared
box would count as CPU of the step).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import xxhash

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import RESULTS
from benchmarks.lib.workers import worker_on
from kvcentric.config import StoreConfig
from kvcentric.connector.vllm.engine_layout import EngineLayout
from kvcentric.connector.vllm.mover import ObjectGeometry
from kvcentric.connector.vllm.transfers import StepPlan, TransferSpec
from kvcentric.hashing import KeySpace
from kvcentric.integrity import ObjectRef
from kvcentric.store.local import launcher
from kvcentric.stored_layout import KVLayout

LAYERS, HEADS, HEAD_SIZE = 32, 1, 64
CASES = {"page128": (128, 128), "page16": (16, 256)}  # name -> (page tokens, object tokens)


class Step:
    """A saver and a loader worker over ``objects`` objects of one case."""

    def __init__(self, case: str, objects: int, cfg: StoreConfig) -> None:
        page, obj = CASES[case]
        k = obj // page
        self.obj_tokens = obj
        nb = objects * k + 8
        shape = (nb, HEADS, page, 2 * HEAD_SIZE)
        page_bytes = HEADS * page * 2 * HEAD_SIZE * 2  # bfloat16
        kv = KVLayout(num_layers=LAYERS, block_size=obj, num_kv_heads=HEADS,
                      head_dim=HEAD_SIZE, dtype="bfloat16", layout=f"bench:cpu:{case}",
                      mla=False)
        self.engine = EngineLayout(kv, ObjectGeometry(LAYERS, k, page_bytes),
                                   KeySpace("bench-step", kv.signature()), page)
        self.src = {f"l{i}": torch.randn(shape, dtype=torch.bfloat16) for i in range(LAYERS)}
        self.dst = {n: torch.zeros_like(t) for n, t in self.src.items()}
        self.pages = [[i * k + j for j in range(k)] for i in range(objects)]
        self.ids = torch.tensor([p for ps in self.pages for p in ps])
        self.buf = torch.empty((LAYERS, len(self.ids), *shape[1:]), dtype=torch.bfloat16)
        self.run = uuid.uuid4().hex
        self.saver = worker_on(cfg, self.engine, self.src)
        self.loader = worker_on(cfg, self.engine, self.dst)

    def refs(self, tag: str) -> list[ObjectRef]:
        """The objects of step ``tag``: keys of this Step's own (the store keeps the first
        object of a key, as a key names its content)."""
        return [ObjectRef(xxhash.xxh3_128_digest(f"{self.run}-{tag}-{i}".encode()), i,
                          self.obj_tokens) for i in range(len(self.pages))]

    def save(self, tag: str) -> tuple[float, float]:
        refs = self.refs(tag)
        plan = StepPlan(saves=[TransferSpec(tag, refs, self.pages, [None] * len(refs))],
                        commit_now=True)
        t0, c0 = time.perf_counter(), time.process_time()
        self.saver.plan_saves(plan)
        for name, layer in self.src.items():
            self.saver.save_layer(name, layer)
        self.saver.finish_step()
        return time.perf_counter() - t0, time.process_time() - c0

    def load(self, tag: str) -> tuple[float, float]:
        plan = StepPlan(loads=[TransferSpec(tag, self.refs(tag), self.pages)])
        t0, c0 = time.perf_counter(), time.process_time()
        self.loader.start_load(plan)
        for name in self.dst:
            self.loader.wait_for_layer(name)
        self.loader.finish_step()
        took = time.perf_counter() - t0, time.process_time() - c0
        if self.loader.take_load_errors():
            raise RuntimeError("a load failed")
        return took

    def copy(self) -> float:
        c0 = time.process_time()
        for i, layer in enumerate(self.src.values()):
            torch.index_select(layer, 0, self.ids, out=self.buf[i])
        return time.process_time() - c0

    def close(self) -> None:
        self.saver.close()
        self.loader.close()


def measure(case: str, objects: int, steps: int, cfg: StoreConfig) -> dict[str, Any]:
    st = Step(case, objects, cfg)
    try:
        for i in range(10):  # warm: the arena's pages, the plans' first allocations
            st.save(f"w{i}")
            st.load(f"w{i}")
        saves, loads, copies = [], [], []
        for i in range(steps):
            saves.append(st.save(f"s{i}"))
            loads.append(st.load(f"s{i}"))
            copies.append(st.copy())
            if not torch.equal(st.dst["l0"][st.ids], st.src["l0"][st.ids]):
                raise RuntimeError("the loaded pages differ from the saved ones")
    finally:
        st.close()
    med = statistics.median
    return {"case": case, "objects": objects, "steps": steps,
            "step_bytes": LAYERS * len(st.ids) * st.engine.geometry.page_bytes,
            "save_cpu_ms": med(c for _, c in saves) * 1e3,
            "save_wall_ms": med(w for w, _ in saves) * 1e3,
            "load_cpu_ms": med(c for _, c in loads) * 1e3,
            "load_wall_ms": med(w for w, _ in loads) * 1e3,
            "copy_cpu_ms": med(copies) * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="50 steps a case")
    ap.add_argument("--steps", type=int, default=None, help="steps a case (default 200)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: results/worker_step[_quick].json")
    args = ap.parse_args(argv)
    steps = args.steps or (50 if args.quick else 200)
    out = args.out or RESULTS / f"worker_step{'_quick' if args.quick else ''}.json"
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="kvc-bench-step-", dir="/dev/shm"))
    cfg = StoreConfig.from_dict({"name": f"ws{uuid.uuid4().hex[:8]}",
                                 "capacity_bytes": 256 << 20, "runtime_dir": tmp,
                                 "prefault": False})
    rows = []
    try:
        for case in CASES:
            for objects in (1, 8):
                row = measure(case, objects, steps, cfg)
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in row.items()}), flush=True)
    finally:
        launcher.stop(cfg)
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {f"{r['case']}_{r['objects']}_{kind}_cpu_ms": r[f"{kind}_cpu_ms"]
               for r in rows for kind in ("save", "load", "copy")}
    rw.write(out, {"summary": summary, "rows": rows, "layers": LAYERS, "heads": HEADS,
                   "head_size": HEAD_SIZE, "quick": args.quick},
             table=json.dumps(summary, indent=2), command=rw.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
