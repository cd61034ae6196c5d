"""A fleet result's arithmetic: per-run rows in emulated time, medians and ranges over
repetitions, parity verdicts, the per-request join of client and engine records."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.serving.fleet_report import aggregate, per_request, verdicts
from benchmarks.serving.fleet_runs import summary_row


def result(ttft_s: list[float], dilation: float, rep: int = 0) -> dict[str, Any]:
    """A benchmark result as :func:`benchmarks.serving.loadgen.benchmark` returns it."""
    reqs = [{"sid": i, "turn": 0, "success": True, "ttft_s": t, "start_s": float(i),
             "router_s": 0.01 * (i + 1)} for i, t in enumerate(ttft_s)]
    summary = {"ttft_mean_ms": 1e3 * sum(ttft_s) / len(ttft_s), "ttft_p50_ms": 1000.0,
               "ttft_p90_ms": 2000.0, "ttft_p99_ms": 3000.0, "tpot_mean_ms": 50.0,
               "goodput": 2.0, "request_throughput": 4.0, "completed": len(ttft_s)}
    return {"summary": summary, "requests": reqs, "rep": rep, "dilation": dilation,
            "label": "arm", "server_metrics": {"hit_tokens_local": 10},
            "emulator": {"busy_total_s": 8.0, "lag_p99_max_s": 0.02, "loop_lag_max_s": 0.04},
            "router_cpu_s": 0.5}


def test_a_dilated_runs_times_and_rates_are_reported_in_emulated_time() -> None:
    row = summary_row(result([1.0, 3.0], dilation=2.0))
    assert row["ttft_mean_ms"] == pytest.approx(1000.0)  # 2000 wall ms / 2
    assert row["ttft_p90_ms"] == pytest.approx(1000.0)
    assert row["goodput"] == pytest.approx(4.0) and row["request_throughput"] == 8.0
    assert row["engine_busy_s"] == pytest.approx(4.0)
    assert row["router_cpu_ms_per_request"] == pytest.approx(250.0)
    assert row["router_added_p50_ms"] == pytest.approx(7.5)  # median of 10, 20 ms over 2


def test_medians_and_ranges_over_repetitions_and_parity() -> None:
    rows: dict[str, list[dict[str, Any]]] = {
        "a": [{"ttft_mean_ms": x} for x in (100.0, 300.0, 200.0)],
        "b": [{"ttft_mean_ms": x} for x in (250.0, 400.0, 260.0)],
        "c": [{"ttft_mean_ms": x} for x in (310.0, 500.0, 320.0)],
        "d": [{"ttft_mean_ms": None}]}
    arms = aggregate(rows)
    by = {a["label"]: a for a in arms}
    assert by["a"]["summary"]["ttft_mean_ms"] == 200.0
    assert by["a"]["range"]["ttft_mean_ms"] == [100.0, 300.0]
    assert by["d"]["summary"]["ttft_mean_ms"] is None and "ttft_mean_ms" not in by["d"]["range"]
    v = verdicts(arms, "ttft_mean_ms", lower=True)
    assert v == {"a": "best", "b": "parity", "c": "behind"}


def test_per_request_joins_client_and_engine_records_on_the_request_id() -> None:
    res = result([0.5, 0.7], dilation=1.0)
    res["engine_requests"] = [
        {"request_id": "arm.0/0/0", "engine": "emu1", "arrival": 10.0, "admitted": 10.1,
         "first_token": 10.4, "local_hit": 256, "external_hit": 0, "prompt_tokens": 300}]
    out = per_request(res, ["u0", "u1"])
    cols = out["columns"]
    assert cols["instance"] == [1] and cols["engine_ttft_ms"] == [400.0]
    assert cols["queue_ms"] == [100.0] and cols["ttft_ms"] == [500.0]
    assert out["served_per_instance"] == [0, 1]  # the unmatched request is left out


def test_a_warmed_hot_prefix_workload_serves_each_prefix_once_first() -> None:
    from benchmarks.serving.fleet_compare import warmed
    from kvcentric.bench_serving.workloads import Session, Turn, Workload

    a, b = (1, 2, 3), (4, 5, 6)
    w = Workload("shared-prefix", [Session(f"s{i}", float(i), (Turn((9, 8, i), 16),), sy)
                                   for i, sy in enumerate((a, b, a, a, b))])
    out = warmed(w)
    assert out.sessions == w.sessions and out.info["warmup_prefixes"] == 2
    assert [(s.system, s.turns[0].user, s.turns[0].output_len) for s in out.warmup] == [
        (a, (9,), 1), (b, (9,), 1)]


def test_a_pd_runs_hits_are_the_prefill_engines_only() -> None:
    """The decode engine loading what the prefill engine just computed is the P/D
    transfer: counted as a hit, a hot-prefix run's hit rate came out near 2."""
    from benchmarks.serving.fleet_runs import prefill_hits

    res = result([1.0, 1.0], dilation=1.0)
    res["summary"] |= {"total_input_tokens": 2000, "hit_tokens": 3800.0, "hit_rate": 1.9}
    res["engine_requests"] = [
        {"engine": "emu0", "local_hit": 800, "external_hit": 100},   # prefill: reuse
        {"engine": "emu1", "local_hit": 0, "external_hit": 900},     # prefill: reuse
        {"engine": "emu2", "local_hit": 0, "external_hit": 1000},    # decode: transfer
        {"engine": "emu3", "local_hit": 0, "external_hit": 1000}]    # decode: transfer
    out = prefill_hits(res, {"emu0", "emu1"})
    assert out["summary"]["hit_tokens"] == 1800.0
    assert out["summary"]["hit_rate"] == pytest.approx(0.9)
    m = out["server_metrics"]
    assert (m["hit_tokens_local"], m["hit_tokens_external"]) == (800.0, 1000.0)
    assert m["pd_transfer_tokens"] == 2000.0
    assert summary_row(out)["hit_rate"] == pytest.approx(0.9)
