"""Effective request capacity under SLO, as the Mooncake paper (FAST'25, evaluation) measures it.

A request is *effective* when it was served with TTFT <= the TTFT SLO and TBT <= the TBT
SLO, its TBT being the mean of the longest 10% of its token gaps (:func:`paper_tbt`); a
refused (429) or failed request is not. An arm's *capacity at SLO* is the highest offered
rate at which at least ``threshold`` (90%) of requests are effective, interpolated
linearly between the two measured rates around the first crossing (:func:`capacity_at`).

Used by :mod:`benchmarks.serving.slo_capacity` for both of its engines (the simulator and
the emulated fleet); pure functions, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

THRESHOLD = 0.9


def paper_tbt(gaps: Sequence[float]) -> float:
    """The mean of the longest 10% of ``gaps`` (at least one gap); 0.0 for none (a
    one-token answer has no gap, so no TBT to miss)."""
    if not gaps:
        return 0.0
    k = max(1, math.ceil(len(gaps) * 0.1))
    return float(statistics.fmean(sorted(gaps, reverse=True)[:k]))


@dataclass(frozen=True)
class Slo:
    """The SLOs a request must meet to count, in seconds; ``ValueError`` unless > 0."""

    ttft_s: float
    tbt_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tbt_s > 0):
            raise ValueError(f"SLOs must be > 0, got TTFT {self.ttft_s} s, TBT {self.tbt_s} s")

    def meets(self, ttft_s: float | None, tbt_s: float) -> bool:
        """Served (``ttft_s`` not None) within both SLOs."""
        return ttft_s is not None and ttft_s <= self.ttft_s and tbt_s <= self.tbt_s


@dataclass(frozen=True)
class Served:
    """One request's outcome: ``ttft_s`` None when it was refused or failed; ``tbt_s``
    as :func:`paper_tbt` defines it; hit tokens by where they came from."""

    ttft_s: float | None
    tbt_s: float
    prompt_tokens: int
    engine_hit_tokens: int = 0
    store_hit_tokens: int = 0
    rejected: bool = False


def counted(outs: Sequence[Served], warmup: float) -> list[Served]:
    """``outs`` (in arrival order) without the first ``warmup`` share: served but not
    counted, as a cold fleet's first requests find no cache anywhere, which says nothing
    about a router in steady state."""
    return list(outs[round(warmup * len(outs)):])


def rate_point(outs: Sequence[Served], slo: Slo, offered_rps: float,
               duration_s: float) -> dict[str, Any]:
    """The numbers of one run at one offered rate: the effective fraction, goodput
    (effective requests per second of the run), TTFT mean/p90/p99 and TBT p90 over the
    served, hit shares by tier (of the served prompts' tokens), refused and failed
    counts. ``ValueError`` when there is no request or the duration is not > 0."""
    if not outs or not duration_s > 0:
        raise ValueError(f"a rate point needs requests and a duration > 0 "
                         f"({len(outs)} requests, {duration_s} s)")
    served = [o for o in outs if o.ttft_s is not None]
    good = sum(slo.meets(o.ttft_s, o.tbt_s) for o in outs)
    ttft = np.asarray([o.ttft_s for o in served], dtype=float)
    tbt = np.asarray([o.tbt_s for o in served], dtype=float)
    tokens = sum(o.prompt_tokens for o in served)

    def pct(a: np.ndarray, p: float) -> float | None:
        return float(np.percentile(a, p)) if a.size else None

    engine = sum(o.engine_hit_tokens for o in served)
    store = sum(o.store_hit_tokens for o in served)
    return {"offered_rps": offered_rps, "requests": len(outs),
            "effective_fraction": good / len(outs), "goodput_rps": good / duration_s,
            "ttft_mean_s": float(ttft.mean()) if ttft.size else None,
            "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
            "tbt_p90_s": pct(tbt, 90),
            "engine_hit_share": engine / tokens if tokens else None,
            "store_hit_share": store / tokens if tokens else None,
            "miss_share": 1 - (engine + store) / tokens if tokens else None,
            "rejected": sum(o.rejected for o in outs),
            "failed": sum(o.ttft_s is None and not o.rejected for o in outs)}


def capacity_at(points: Sequence[tuple[float, float]], threshold: float = THRESHOLD
                ) -> tuple[float | None, str]:
    """(capacity, how it was found) from (offered rate, effective fraction) points.

    Scanning up from the lowest rate, the first rate whose fraction is below
    ``threshold`` ends the scan; the capacity is where the line between it and the
    rate before it crosses ``threshold`` ("interpolated"). ``(None, "below")`` when even
    the lowest rate misses (the sweep started too high); ``(highest rate, "above")``
    when no rate misses (a lower bound: the sweep stopped too low).
    ``ValueError`` when there are no points or two share a rate."""
    pts = sorted(points)
    if not pts:
        raise ValueError("no rate points")
    if len({r for r, _ in pts}) != len(pts):
        raise ValueError(f"two points at one rate: {pts}")
    if pts[0][1] < threshold:
        return None, "below"
    for (r0, f0), (r1, f1) in zip(pts, pts[1:]):
        if f1 < threshold:
            return r0 + (r1 - r0) * (f0 - threshold) / (f0 - f1), "interpolated"
    return pts[-1][0], "above"


def median_rows(reps: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Per rate, the median over repetitions of every number (and ``<key>_range``
    [min, max] of the effective fraction and TTFT mean); ``reps[k]`` is repetition
    ``k``'s rows, one per rate, in the same rate order."""
    out = []
    for rows in zip(*reps):
        merged: dict[str, Any] = {"offered_rps": rows[0]["offered_rps"], "reps": len(rows)}
        for key in rows[0]:
            vals = [r[key] for r in rows if r.get(key) is not None]
            if key == "offered_rps" or not all(isinstance(v, (int, float)) for v in vals):
                continue
            merged[key] = float(statistics.median(vals)) if vals else None
            if key in ("effective_fraction", "ttft_mean_s") and vals:
                merged[f"{key}_range"] = [min(vals), max(vals)]
        out.append(merged)
    return out


def arm_capacity(reps: Sequence[Sequence[Mapping[str, Any]]],
                 threshold: float = THRESHOLD) -> dict[str, Any]:
    """An arm's capacity from its repetitions' rows: of the median rows' fractions
    (``capacity_rps``), and each repetition's alone (``capacity_rps_reps``, their spread)."""
    med = median_rows(reps)
    cap, how = capacity_at([(r["offered_rps"], r["effective_fraction"]) for r in med],
                           threshold)
    each = [capacity_at([(r["offered_rps"], r["effective_fraction"]) for r in rows],
                        threshold)[0] for rows in reps]
    return {"capacity_rps": cap, "capacity_found": how, "capacity_rps_reps": each,
            "rows": med}


def figure5_ordering(ttft_mean: Mapping[str, float | None], ordered: Sequence[str],
                     margin: float = 0.10) -> bool | None:
    """Whether mean TTFTs fall strictly along ``ordered`` (worst first, as the paper's
    Figure 5: random, load-balancing, local cache-aware, global cache-aware) and the last
    is at least ``margin`` below the one before it; None when one is missing."""
    vals = [ttft_mean.get(k) for k in ordered]
    if any(v is None for v in vals):
        return None
    xs = [float(v) for v in vals if v is not None]
    return all(a > b for a, b in zip(xs, xs[1:])) and xs[-1] <= (1 - margin) * xs[-2]
