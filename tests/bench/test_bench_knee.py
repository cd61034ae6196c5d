"""benchmarks/serving/knee.py: the pure parts (workload arithmetic, knee detection, summary
keys, per-point rows and the figure), without starting vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.serving import knee as bk
from benchmarks.serving.fleet import CPU_PAGE

PLAN = bk.KneePlan(sessions=4, turns=3, doc_len=1023, turn_input_len=100, output_len=28,
                   concurrency=2, fractions=(0.25, 0.5, 1.0, 2.0))


def test_working_set_arithmetic() -> None:
    # BOS + document + first message, then + answer + message per turn
    assert PLAN.prompt_lens() == [1124, 1252, 1380]
    assert PLAN.session_tokens() == 1408 == 1 + 1023 + 3 * (100 + 28)
    assert PLAN.working_set_tokens() == 4 * 1408
    assert PLAN.max_model_len() == 11 * CPU_PAGE  # 1408 rounded up to whole blocks


def test_reuse_ceiling_counts_full_blocks_of_the_previous_prompt() -> None:
    # turn 0 reuses the warmed BOS + document (1024 tokens: 8 blocks), turn 1 the
    # 1124-token prompt (8 blocks), turn 2 the 1252-token prompt (9 blocks)
    expected = (1024 + 1024 + 1152) / (1124 + 1252 + 1380)
    assert PLAN.reuse_ceiling() == pytest.approx(expected)
    # a prompt never hits its own last token: a prefix of exactly one block is reusable
    # only when the prompt is longer than it
    assert bk.KneePlan(1, 1, 127, 10, 1, 1, (0.5, 1.0)).reuse_ceiling() == 128 / 138
    assert bk.KneePlan(1, 1, 100, 10, 1, 1, (0.5, 1.0)).reuse_ceiling() == 0.0


def test_capacities_are_whole_blocks_at_least_one_context_and_distinct() -> None:
    caps = PLAN.capacities()
    assert caps == sorted(set(caps)) and all(c % CPU_PAGE == 0 for c in caps)
    assert caps[0] == PLAN.max_model_len() + CPU_PAGE  # the floor: one context + null block
    assert caps[-1] == round(2.0 * PLAN.working_set_tokens() / CPU_PAGE) * CPU_PAGE
    assert bk.QUICK.capacities()[0] < bk.QUICK.working_set_tokens() < bk.QUICK.capacities()[-1]
    assert bk.FULL.capacities()[0] < bk.FULL.working_set_tokens() < bk.FULL.capacities()[-1]
    assert len(bk.QUICK.capacities()) >= 6 and len(bk.FULL.capacities()) >= 6


@pytest.mark.parametrize("bad", [dict(sessions=0), dict(fractions=(1.0,)),
                                 dict(fractions=(0.0, 1.0)), dict(disk_dram_fraction=0.0)])
def test_plan_rejects_bad_values(bad: dict[str, Any]) -> None:
    kw: dict[str, Any] = dict(sessions=2, turns=2, doc_len=10, turn_input_len=5,
                              output_len=2, concurrency=1, fractions=(0.5, 1.0)) | bad
    with pytest.raises(ValueError):
        bk.KneePlan(**kw)


def test_knee_is_the_smallest_capacity_reaching_90_percent_of_the_max() -> None:
    curve = [(4096, 0.05), (1024, 0.0), (8192, 0.70), (12288, 0.80), (16384, 0.78)]
    assert bk.knee_capacity(curve) == 12288  # 0.70 < 0.9 * 0.80 = 0.72
    assert bk.knee_capacity(curve, share=0.85) == 8192
    assert bk.knee_capacity([(1, 0.0), (2, None)]) is None
    assert bk.knee_capacity([]) is None


def row(cap: int, arm: str, hit: float, p90: float) -> dict[str, Any]:
    return {"capacity_tokens": cap, "arm": arm, "status": "ok", "engine_hit_ratio": hit,
            "reuse": hit, "ttft_p90_ms": p90}


def test_summary_keys() -> None:
    rows = [row(1024, bk.ALONE, 0.0, 3000.0), row(1024, bk.STORE, 0.1, 500.0),
            row(1024, bk.DISK, 0.1, 700.0), row(2048, bk.ALONE, 0.5, 2000.0),
            row(4096, bk.ALONE, 0.9, 400.0), row(8192, bk.ALONE, 0.92, 300.0),
            row(16384, bk.ALONE, 0.91, 600.0),
            {"capacity_tokens": 2048, "arm": bk.STORE, "status": "failed: x"}]
    s = bk.summarize(rows)
    assert s["knee_capacity_tokens"] == 4096 and s["smallest_capacity_tokens"] == 1024
    assert s["alone_p90_above_knee_ms"] == 400.0  # median of 400, 300, 600
    assert s["alone_p90_at_min_over_above_knee"] == 7.5
    assert s["store_p90_at_min_over_above_knee"] == 1.25
    assert s["disk_p90_at_min_over_above_knee"] == 1.75
    assert s["target_met"] is True
    s = bk.summarize([r for r in rows if r["arm"] != bk.STORE])
    assert s["store_p90_at_min_over_above_knee"] is None and s["target_met"] is False


def test_point_row_ratios_come_from_metric_deltas() -> None:
    res: dict[str, Any] = {"server_metrics": {"total": {
        "vllm:prefix_cache_hits_total": 300.0, "vllm:prefix_cache_queries_total": 1000.0,
        "vllm:external_prefix_cache_hits_total": 500.0,
        "vllm:external_prefix_cache_queries_total": 625.0}},
        "summary": {"ttft_p50_ms": 1.0, "ttft_p90_ms": 2.0, "e2e_p90_ms": 3.0,
                    "completed": 9, "num_requests": 9, "failed": 0, "duration_s": 4.0}}
    r = bk.point_row(2816, bk.STORE, PLAN, res)
    assert r["engine_hit_ratio"] == 0.3 and r["store_hit_ratio"] == 0.8
    assert r["reuse"] == 0.8 and r["capacity_blocks"] == 22
    assert r["fraction_of_working_set"] == 0.5
    res["server_metrics"]["total"] = {"vllm:prefix_cache_hits_total": 0.0,
                                      "vllm:prefix_cache_queries_total": 0.0}
    r = bk.point_row(2816, bk.ALONE, PLAN, res)  # nothing queried, no connector: n/a
    assert r["engine_hit_ratio"] is None and r["store_hit_ratio"] is None


def test_arms_get_fresh_stores(tmp_path: Path) -> None:
    alone = bk.arm_for(bk.ALONE, PLAN, 8192, tmp_path)
    assert alone.kv_transfer is None and alone.store is None
    a, b = (bk.arm_for(bk.STORE, PLAN, 8192, tmp_path) for _ in range(2))
    assert a.store and b.store and a.store["name"] != b.store["name"]
    assert a.kv_transfer and a.kv_transfer["kv_connector_extra_config"]["store"] == a.store
    disk = bk.arm_for(bk.DISK, PLAN, 8192, tmp_path)
    ws_bytes = PLAN.working_set_tokens() * 8192
    assert disk.store and disk.store["capacity"] < ws_bytes <= disk.store["disk"]["capacity"]
    with pytest.raises(ValueError):
        bk.arm_for("nope", PLAN, 8192, tmp_path)


def test_draw_and_table(tmp_path: Path) -> None:
    rows = [row(1024, bk.ALONE, 0.0, 3000.0), row(1024, bk.STORE, 0.8, 500.0),
            row(4096, bk.ALONE, 0.8, 400.0), row(4096, bk.STORE, 0.85, 380.0)]
    doc = {"points": rows, "summary": bk.summarize(rows),
           "workload": {"working_set_tokens": 3000, "reuse_ceiling": 0.85}}
    bk.draw(doc, tmp_path / "k.png")
    assert (tmp_path / "k.png").stat().st_size > 1000
    text = bk.table(doc)
    assert "knee_capacity_tokens: 4096" in text and "vllm-alone" in text
