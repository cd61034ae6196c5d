"""What would PIECEWISE CUDA graphs cost a decode step, next to the FULL graphs we keep?

A connector that declares ``requires_piecewise_for_cudagraph`` makes vLLM split every
decode graph at each attention op, which then runs eagerly between graph pieces. We keep
``FULL_AND_PIECEWISE`` instead (a full-graph step loads before and saves after the
forward, docs/connector.md §CUDA graphs). This measures the difference on a forward
stand-in with a Llama-3-8B-shaped decoder (32 layers, hidden 4096, 32 query / 8 KV heads,
MLP 14336, bf16): per-forward time of one full graph, of PIECEWISE (a graph per segment
between attention ops, attention eager with a call where the connector's hooks sit), and
of eager execution, for decode batches of 1, 16 and 64 requests with 1024 tokens of
context each. Needs CUDA.

    python -m benchmarks.micro.cudagraph_modes [--out FILE.json]

writes ``benchmarks/results/cudagraph_modes_<device>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.lib import results_writer as rw
from benchmarks.lib.paths import ROOT

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 32, 4096, 32, 8, 128, 14336
CONTEXT = 1024


class Decoder:
    """Random bf16 weights and a KV cache per layer; :meth:`pre` / :meth:`attn` /
    :meth:`post` are the segments vLLM's piecewise split cuts at."""

    def __init__(self, batch: int, layers: int) -> None:
        dev, dt = "cuda", torch.bfloat16
        self.layers = layers
        qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.w = [{"qkv": torch.randn(HIDDEN, qkv, device=dev, dtype=dt) * 0.01,
                   "o": torch.randn(HEADS * HEAD_DIM, HIDDEN, device=dev, dtype=dt) * 0.01,
                   "up": torch.randn(HIDDEN, 2 * MLP, device=dev, dtype=dt) * 0.01,
                   "down": torch.randn(MLP, HIDDEN, device=dev, dtype=dt) * 0.01}
                  for _ in range(layers)]
        self.k = [torch.randn(batch, KV_HEADS, CONTEXT, HEAD_DIM, device=dev, dtype=dt)
                  for _ in range(layers)]
        self.v = [torch.randn_like(k) for k in self.k]
        self.x = torch.randn(batch, HIDDEN, device=dev, dtype=dt)
        self.hook_calls = 0

    def pre(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (HIDDEN,)) @ self.w[i]["qkv"]

    def attn(self, i: int, qkv: torch.Tensor) -> torch.Tensor:
        self.hook_calls += 1  # where wait_for_layer_load / save_kv_layer run
        b = qkv.shape[0]
        q = qkv[:, :HEADS * HEAD_DIM].view(b, HEADS, 1, HEAD_DIM)
        out = F.scaled_dot_product_attention(q, self.k[i], self.v[i], enable_gqa=True)
        return out.reshape(b, HEADS * HEAD_DIM)

    def post(self, i: int, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        h = x + a @ self.w[i]["o"]
        gate, up = (F.rms_norm(h, (HIDDEN,)) @ self.w[i]["up"]).chunk(2, dim=-1)
        return h + (F.silu(gate) * up) @ self.w[i]["down"]

    def forward(self) -> torch.Tensor:
        x = self.x
        for i in range(self.layers):
            x = self.post(i, x, self.attn(i, self.pre(i, x)))
        return x


def capture(fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn`` captured as one CUDA graph (after a warm-up); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def piecewise(m: Decoder) -> Callable[[], None]:
    """vLLM's PIECEWISE: a graph per segment between attention ops (``post`` of layer i
    and ``pre`` of layer i+1 form one segment), attention eager in between."""
    qkv: list[torch.Tensor] = [torch.empty(0)] * m.layers
    att: list[torch.Tensor] = [torch.empty(0)] * m.layers
    xs: list[torch.Tensor] = [m.x] + [torch.empty(0)] * m.layers

    def seg(i: int) -> Callable[[], None]:
        def run() -> None:
            if i:
                xs[i] = m.post(i - 1, xs[i - 1], att[i - 1])
            if i < m.layers:
                qkv[i] = m.pre(i, xs[i])
        return run

    # static buffers: run once eagerly so every segment's inputs exist, then capture
    for i in range(m.layers + 1):
        seg(i)()
        if i < m.layers:
            att[i] = m.attn(i, qkv[i])
    graphs = [capture(seg(i)) for i in range(m.layers + 1)]

    def step() -> None:
        for i in range(m.layers):
            graphs[i]()
            att[i].copy_(m.attn(i, qkv[i]))
        graphs[m.layers]()
    return step


def timed(fn: Callable[[], Any], iters: int) -> float:
    """Milliseconds per call, CUDA events around ``iters`` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def measure(batch: int, layers: int, iters: int, reps: int) -> dict[str, Any]:
    m = Decoder(batch, layers)
    modes = {"full": capture(m.forward), "piecewise": piecewise(m), "eager": m.forward}
    runs: dict[str, list[float]] = {k: [] for k in modes}
    for _ in range(reps):
        for name, fn in modes.items():
            runs[name].append(timed(fn, iters))
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"batch": batch, "runs_ms": {k: [round(x, 4) for x in v] for k, v in runs.items()},
            "median_ms": {k: round(v, 4) for k, v in med.items()},
            "piecewise_over_full": round(med["piecewise"] / med["full"], 3),
            "piecewise_minus_full_ms": round(med["piecewise"] - med["full"], 4),
            "spread_overlaps": min(runs["piecewise"]) <= max(runs["full"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    rows = [measure(b, args.layers, args.iters, args.reps) for b in args.batches]
    device = torch.cuda.get_device_name().replace(" ", "_")
    out = args.out or ROOT / "benchmarks" / "results" / f"cudagraph_modes_{device}.json"
    lines = [f"{'batch':>5} {'full ms':>8} {'piecewise':>9} {'eager':>8} {'pw/full':>7}"]
    for r in rows:
        med = r["median_ms"]
        lines.append(f"{r['batch']:>5} {med['full']:>8.3f} {med['piecewise']:>9.3f} "
                     f"{med['eager']:>8.3f} {r['piecewise_over_full']:>7.3f}")
    doc = {"benchmark": "cudagraph_modes", "model": {"layers": args.layers, "hidden": HIDDEN,
                                                    "heads": HEADS, "kv_heads": KV_HEADS,
                                                    "mlp": MLP, "context": CONTEXT},
           "rows": rows, "summary": {f"b{r['batch']}_piecewise_over_full":
                                     r["piecewise_over_full"] for r in rows}}
    rw.write(out, doc, table="\n".join(lines), command=rw.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
