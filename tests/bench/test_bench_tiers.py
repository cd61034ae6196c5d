"""benchmarks/serving/tiers.py: the parts that decide what a measurement means (which tier
served a request, the floors, the summary against the targets), without starting vLLM;
plus the cold-read floor against a real file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.serving import tiers as bt
from kvcentric import disk_probe
from tests.helpers.disk import device_dir

BPT = 8192  # the bench model: 8 layers x 4 KV heads x 64 x bf16 x (K, V)


def served(engine: int = 0, connector: int = 0, dram: int = 0, disk: int = 0,
           device: int = 0) -> dict[str, Any]:
    return {"engine_tokens": engine, "connector_tokens": connector, "dram_hits": dram,
            "disk_hits": disk, "device_bytes": device}


def test_kv_bytes_per_token_from_the_model_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4,
        "num_hidden_layers": 8}))
    assert bt.kv_bytes_per_token(tmp_path) == BPT


@pytest.mark.parametrize("tier, r, why", [
    ("miss", served(), None),
    ("miss", served(connector=128), "miss hit"),
    ("engine", served(engine=3968), None),
    ("engine", served(connector=4095), "engine hit"),
    ("dram", served(connector=4095, dram=32), None),
    ("dram", served(engine=3968, connector=127, dram=1), "dram hit"),  # engine served it
    ("dram", served(connector=4095, dram=30, disk=2), "from disk"),
    ("disk", served(connector=4095, disk=32, device=4095 * BPT), None),
    ("disk", served(connector=4095, disk=30, dram=2, device=4095 * BPT), "from DRAM"),
    ("disk", served(connector=4095, disk=32, device=1 << 20), "page cache"),
])
def test_each_request_must_prove_its_tier(tier: str, r: dict[str, Any],
                                          why: str | None) -> None:
    got = bt.check_tier(tier, r, BPT)
    assert (got is None) if why is None else (got is not None and why in got), got


def _row(n: int, miss: float, disk: float, dram: float, engine: float, floor_disk: float,
         floor_dram: float) -> dict[str, Any]:
    return {"prompt_len": n, "miss_ms": miss, "disk_ms": disk, "dram_ms": dram,
            "engine_ms": engine, "disk_over_floor": disk / floor_disk,
            "dram_over_floor": dram / floor_dram, "dram_over_engine": dram / engine,
            "tokens_identical": True, "store_matches_engine_hit": True,
            "tiers_verified": True}


def test_summary_is_at_the_largest_length_and_judges_the_8k_targets() -> None:
    rows = [_row(8192, 20000, 2000, 500, 450, 1600, 460),  # disk 1.25x floor, 0.1x miss
            _row(16384, 80000, 3000, 900, 800, 2000, 850)]
    s = bt.summarize(rows)
    assert s["max_len"] == 16384 and s["disk_hit_over_miss"] == 3000 / 80000
    assert s["disk_hit_over_floor"] == 1.5 and s["dram_hit_over_engine_hit"] == 900 / 800
    assert s["at_8192"]["dram_hit_over_floor"] == 500 / 460
    assert s["targets_met_at_8192"] is True
    rows[0] = _row(8192, 20000, 2100, 500, 450, 1600, 460)  # disk 1.31x its floor
    assert bt.summarize(rows)["targets_met_at_8192"] is False
    assert "at_8192" not in bt.summarize(rows[1:])


def test_cold_read_floor_reads_from_the_device() -> None:
    with device_dir() as d:  # on the checkout's disk: a tmpfs tmp dir reaches no device
        cold = disk_probe.cold_read(d, (8 << 20) + 4096, reps=2)  # a partial last chunk
        assert cold.seconds > 0 and not list(d.iterdir())  # its file is removed
    if cold.device_fraction == 0:  # a filesystem without per-task I/O accounting
        pytest.skip(f"no block device with I/O accounting under {d.parent}")
    assert cold.device_fraction >= 0.9


def test_a_rep_whose_tiers_disagree_is_reported_with_its_margins(tmp_path: Path) -> None:
    def rep(token: int, margin: float) -> dict[str, Any]:
        return {**served(connector=128), "s": 0.1, "token": [token], "margin": margin,
                "connector_s": {"load_seconds": 0.01}}

    got = {t: [rep(7, 0.5), rep(7, 0.01)] for t in bt.TIERS}
    row = bt.row_for(1024, got, [], BPT, tmp_path)
    assert row["tokens_identical"] and row["token_mismatches"] == []
    assert row["store_matches_engine_hit"]
    got["miss"][1] = rep(9, 0.125)  # a near-tie the miss broke the other way
    row = bt.row_for(1024, got, [], BPT, tmp_path)
    assert not row["tokens_identical"] and row["store_matches_engine_hit"]
    (m,) = row["token_mismatches"]
    assert m["rep"] == 1 and m["miss"] == {"token": [9], "margin": 0.125}
    assert m["disk"] == {"token": [7], "margin": 0.01}
    assert "rep 1: tiers disagree: miss [9] (margin 0.125)" in bt.table([row], {}, 2)
    got["disk"][0] = rep(8, 0.5)  # a store hit that differs from the engine's own hit
    row = bt.row_for(1024, got, [], BPT, tmp_path)
    assert not row["store_matches_engine_hit"]
    assert bt.table([row], {}, 2).splitlines()[2].endswith("NO")
