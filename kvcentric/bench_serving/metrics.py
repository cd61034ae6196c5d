"""Per-request records and their aggregates, defined as ``vllm bench serve`` defines them.

- TTFT: request sent -> first streamed content. E2E: request sent -> stream end.
- TPOT: ``(e2e - ttft) / (output_tokens - 1)`` over requests with more than one output
  token (for goodput a one-token request's TPOT counts as 0, as in vLLM).
- ITL: the gaps between consecutive content chunks, pooled over all requests.
- Throughputs divide by the run's wall time; goodput counts completed requests that meet
  every SLO given, per second (``None`` when no SLO is given).
- Percentiles are numpy's linear interpolation. A statistic over no values is ``None``
  (never 0, which would read as a perfect latency).
- ``failed`` counts unsuccessful requests other than HTTP 429, which are ``rejected``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds, ``start_s`` from the run start."""

    sid: str
    turn: int
    url: str
    start_s: float
    prompt_len: int
    max_tokens: int
    success: bool = False
    status: int | None = None
    error: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    server_prompt_tokens: int | None = None
    cached_tokens: int | None = None
    retries: int = 0  # 429s answered by waiting Retry-After and sending again
    failovers: int = 0  # connections refused, the request sent to the next URL instead
    predicted_ttft_s: float | None = None  # the kvcentric router's prediction (its header)
    router_s: float | None = None  # what the kvcentric router took before dispatching it

    @property
    def rejected(self) -> bool:
        return self.status == 429

    @property
    def tpot_s(self) -> float:
        if self.output_tokens <= 1:
            return 0.0
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    def meets(self, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
        """Completed within both SLOs (an absent SLO always holds)."""
        return self.success \
            and (slo_ttft_ms is None or self.ttft_s * 1e3 <= slo_ttft_ms) \
            and (slo_tpot_ms is None or self.tpot_s * 1e3 <= slo_tpot_ms)


def _stats(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    arr = np.asarray(values_s, dtype=float) * 1e3
    out[f"{name}_mean_ms"] = float(arr.mean()) if arr.size else None
    out[f"{name}_std_ms"] = float(arr.std()) if arr.size else None
    for p in PERCENTILES:
        out[f"{name}_p{p}_ms"] = float(np.percentile(arr, p)) if arr.size else None
    return out


def _reason(rec: RequestRecord) -> str:
    return rec.error.splitlines()[0][:160] if rec.error else f"HTTP {rec.status}"


def prediction_error(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """|actual - predicted| / actual TTFT over the successful first tries the router
    predicted (a retried request's TTFT counts its waits, which no prediction covers)."""
    errs = [abs(r.ttft_s - r.predicted_ttft_s) / r.ttft_s for r in records
            if r.predicted_ttft_s is not None and r.retries == 0 and r.ttft_s > 0]
    arr = np.asarray(errs, dtype=float)
    return {"predicted_requests": len(errs),
            "prediction_error_median": float(np.median(arr)) if arr.size else None,
            "prediction_error_p90": float(np.percentile(arr, 90)) if arr.size else None}


def summarize(records: Sequence[RequestRecord], duration_s: float,
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
              hit_tokens: float | None = None) -> dict[str, Any]:
    """The summary dict written to ``--out`` (see the module docstring for definitions).

    ``hit_tokens``: prefix-cache hit tokens from the servers' counters; when None, the
    sum of the per-request ``cached_tokens`` the servers reported, if any did.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    ok = [r for r in records if r.success]
    bad = [r for r in records if not r.success and not r.rejected]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "duration_s": duration_s, "num_requests": len(records), "completed": len(ok),
        "failed": len(bad), "rejected": sum(r.rejected for r in records),
        "retried_429": sum(r.retries for r in records),
        "failovers": sum(r.failovers for r in records),
        "failure_reasons": dict(Counter(_reason(r) for r in bad)),
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": n_out / duration_s,
        "total_token_throughput": (n_in + n_out) / duration_s,
    }
    out |= _stats("ttft", [r.ttft_s for r in ok])
    out |= prediction_error(ok)
    out |= _stats("tpot", [r.tpot_s for r in ok if r.output_tokens > 1])
    out |= _stats("itl", [x for r in ok for x in r.itl_s])
    out |= _stats("e2e", [r.latency_s for r in ok])
    slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    good = sum(r.meets(slo_ttft_ms, slo_tpot_ms) for r in records)
    out["good_requests"] = good if slo else None
    out["goodput"] = good / duration_s if slo else None
    out["slo_attainment"] = good / len(records) if slo and records else None
    if hit_tokens is None:
        cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
        hit_tokens = float(sum(cached)) if cached else None
    out["hit_tokens"] = hit_tokens
    out["hit_rate"] = hit_tokens / n_in if hit_tokens is not None and n_in else None
    return out


def format_table(s: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """A ``vllm bench serve``-style text table of a summary."""
    lines = [f"{' ' + title + ' ':=^50}"]

    def row(label: str, value: Any, fmt: str = "{:<10.2f}") -> None:
        text = "n/a" if value is None else (fmt.format(value) if not isinstance(value, str)
                                            else value)
        lines.append(f"{label:<40} {text}")

    row("Successful requests:", s["completed"], "{:<10}")
    row("Failed requests:", s["failed"], "{:<10}")
    row("Rejected requests (429):", s["rejected"], "{:<10}")
    row("429s retried after Retry-After:", s.get("retried_429", 0), "{:<10}")
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", s["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", s["request_throughput"])
    row("Request goodput (req/s):", s["goodput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    row("Prefix cache hit tokens:", s["hit_tokens"], "{:<10.0f}")
    if s.get("prediction_error_median") is not None:
        row("Router TTFT prediction error, median:", s["prediction_error_median"], "{:<10.1%}")
    names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2e": "End-to-end Latency"}
    short = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2EL"}
    for key in LATENCIES:
        lines.append(f"{names[key]:-^50}")
        row(f"Mean {short[key]} (ms):", s[f"{key}_mean_ms"])
        for p in PERCENTILES:
            label = "Median" if p == 50 else f"P{p}"
            row(f"{label} {short[key]} (ms):", s[f"{key}_p{p}_ms"])
    for reason, n in s["failure_reasons"].items():
        lines.append(f"failed x{n}: {reason}")
    lines.append("=" * 50)
    return "\n".join(lines)
