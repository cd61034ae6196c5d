"""Measure which copy implementation is fastest for one shape, on the device it runs on.

Triton gathers (SMs reading host memory through UVA) and per-page DMA
(``cudaMemcpyAsync``, copy engines) trade places with the page size and count, and the
answer differs between PCIe generations and GPUs; so instead of a fixed rule the CUDA
worker asks :func:`fastest` once per KV layout at start-up, on its own cache and a
scratch buffer of pinned rows, and uses the winner for every step.

Side effects: :func:`time_impls` writes ``rows`` (pack) and rewrites the listed blocks
of ``layer`` with their own bytes (unpack of what was just packed), so the layer's
contents do not change. On CUDA it synchronises the device around each timed call
(start-up only, never on the serving path).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcentric.kernels.dispatch import explain_impl, pack_blocks, unpack_blocks


@dataclass(frozen=True)
class Pick:
    """The implementation chosen for one direction, with every candidate's median
    seconds per call (candidates that would fall back to another impl are left out)."""

    impl: str
    seconds: dict[str, float]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def candidates(layer: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, block_dim: int,
               wanted: Sequence[str] = ("triton", "dma", "torch")) -> list[str]:
    """``wanted`` impls that really run for these arguments (not a torch fallback)."""
    out = []
    for impl in wanted:
        try:
            choice = explain_impl(layer, ids, rows, block_dim=block_dim, impl=impl)
        except ValueError:  # e.g. triton on CPU without the interpreter
            continue
        if choice.name == impl:
            out.append(impl)
    return out


def time_impls(layer: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, *,
               block_dim: int, pack: bool, impls: Sequence[str],
               repeats: int = 5) -> dict[str, float]:
    """Median seconds per pack (``pack=True``) or unpack of ``ids`` for each impl.

    ``layer``: one KV layer, blocks on ``block_dim``; ``rows``: ``[len(ids), *rest]`` (or
    its uint8 byte view). For unpack, ``rows`` must already hold the packed blocks."""
    out: dict[str, float] = {}
    for impl in impls:
        samples = []
        for k in range(repeats + 1):  # the first call compiles / warms up
            _sync(layer.device)
            t0 = time.perf_counter()
            if pack:
                pack_blocks(layer, ids, rows, block_dim=block_dim, impl=impl)
            else:
                unpack_blocks(rows, ids, layer, block_dim=block_dim, impl=impl)
            _sync(layer.device)
            if k:
                samples.append(time.perf_counter() - t0)
        out[impl] = statistics.median(samples)
    return out


def fastest(layer: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, *,
            block_dim: int, wanted: Sequence[str] = ("triton", "dma", "torch"),
            repeats: int = 5) -> tuple[Pick, Pick]:
    """``(pack pick, unpack pick)`` for this layer shape, ids count and rows memory.
    Packs first (filling ``rows``), then unpacks those same bytes back."""
    impls = candidates(layer, ids, rows, block_dim, wanted) or ["torch"]
    picks = []
    for pack in (True, False):
        secs = time_impls(layer, ids, rows, block_dim=block_dim, pack=pack, impls=impls,
                          repeats=repeats)
        picks.append(Pick(min(secs, key=secs.__getitem__), secs))
    return picks[0], picks[1]
