"""bench_connectors' per-request engine split and its summary (where a hit's time goes,
and the bound on any connector against vLLM's MooncakeStoreConnector)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.serving import connectors, connectors_report


def _counters(queue: float, prefill: float, n: int, wait: float = 0.0) -> dict[str, float]:
    return {"queue_sum": queue, "queue_count": n, "prefill_sum": prefill, "prefill_count": n,
            "vllm:kvcentric_load_wait_seconds_total": wait,
            "vllm:kvcentric_loaded_blocks_total": 7.0}


def test_request_split_is_the_growth_of_each_phase_and_of_our_seconds_counters() -> None:
    split = connectors.request_split(_counters(1.0, 10.0, 3, 0.5),
                                           _counters(1.04, 10.9, 4, 0.515))
    assert split == pytest.approx({"queue": 40.0, "prefill": 900.0, "load_wait": 15.0})


def _arm(ttft: list[float], queue: list[float], prefill: list[float],
         outputs: int = 1) -> dict[str, Any]:
    return {"status": "ok", "ttft_ms": ttft, "ttft_mean_ms": sum(ttft) / len(ttft),
            "ttft_p90_ms": max(ttft), "ttft_median_ms": sorted(ttft)[len(ttft) // 2],
            "hit_tokens": 10.0, "external_hit_tokens": 8.0, "engine_hit_tokens": 2.0,
            "requests_per_s": 1.0, "outputs": [[outputs]],
            "engine_split_ms": [{"queue": q, "prefill": p} for q, p in zip(queue, prefill)]}


def test_summary_splits_later_turns_and_bounds_any_connector() -> None:
    # 2 users: requests 0-1 are first turns (misses), 2-3 later turns with a 50 ms load
    builtin = _arm([5000, 5000, 1050, 1050], [0, 0, 50, 50], [5000, 5000, 1000, 1000])
    ours = _arm([5000, 5000, 1040, 1040], [0, 0, 0, 0], [5000, 5000, 1040, 1040])
    s = connectors_report.summarise({"mooncake_store_connector": builtin, "kvcentric": ours,
                                     "lmcache": {"status": "not run"}}, users=2)
    assert s["later_turns_engine_split_ms"] == {
        "mooncake_store_connector": {"queue": 50.0, "prefill": 1000.0},
        "kvcentric": {"queue": 0.0, "prefill": 1040.0}}
    # however fast a load, the best is the built-in's TTFT without its 2 x 50 ms of loads
    assert s["ttft_zero_cost_load_vs_mooncake_store_connector"] == pytest.approx(12000 / 12100)
    assert s["ttft_kvcentric_vs_mooncake_store_connector"] == pytest.approx(12080 / 12100)
    assert s["outputs_match_between_connectors"] is True


def test_results_without_the_split_still_summarise() -> None:
    old = _arm([5000, 1000], [0, 0], [0, 0])
    del old["engine_split_ms"]
    s = connectors_report.summarise({"mooncake_store_connector": old}, users=1)
    assert s["later_turns_engine_split_ms"] == {}
    assert "ttft_zero_cost_load_vs_mooncake_store_connector" not in s
