"""The router's reader of an engine's ``/metrics`` page agrees with prometheus_client's parser
on vLLM-shaped pages (data-parallel engines, look-alike names, escapes, NaN) and rejects
malformed lines of the series it reads."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcentric.router.fleet.engine_metrics import EngineStats, parse_engine_metrics

CACHE_INFO = ('vllm:cache_config_info{_block_size_resolved="True",block_size="{bs}",'
              'cache_dtype="auto",engine="0",kv_cache_dtype_skip_layers="[]",'
              'note="a \\"quoted\\", {braced} value",num_gpu_blocks="{nb}",'
              'sliding_window="None"} 1.0')


def page(engines: int = 2, usage: str = "0.25", bs: int = 16, nb: int = 2048) -> str:
    """A vLLM-shaped page: HELP/TYPE comments, per-engine gauges, a histogram, names that
    share a prefix with the wanted ones."""
    lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
             "# TYPE vllm:num_requests_running gauge"]
    lines += [f'vllm:num_requests_running{{engine="{e}",model_name="m"}} {e + 1}.0'
              for e in range(engines)]
    lines += ["# TYPE vllm:num_requests_waiting gauge"]
    lines += [f'vllm:num_requests_waiting{{engine="{e}",model_name="m"}} {2 * e + 3}.0'
              for e in range(engines)]
    lines += [f'vllm:num_requests_waiting_by_reason{{engine="{e}",reason="capacity"}} 99.0'
              for e in range(engines)]
    lines += ["# TYPE vllm:kv_cache_usage_perc gauge"]
    lines += [f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} {usage}'
              for e in range(engines)]
    lines += ["# TYPE vllm:time_to_first_token_seconds histogram"]
    lines += [f'vllm:time_to_first_token_seconds_bucket{{le="{le}",model_name="m"}} 4.0'
              for le in ("0.001", "0.5", "+Inf")]
    lines += ["# TYPE vllm:cache_config_info gauge",
              CACHE_INFO.replace("{bs}", str(bs)).replace("{nb}", str(nb)),
              "process_open_fds 17.0", ""]
    return "\n".join(lines)


def reference(text: str) -> EngineStats:
    """The same figures read with prometheus_client's full parser."""
    sums: dict[str, float] = {}
    stats = EngineStats()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:cache_config_info":
                stats.num_pages = int(s.labels["num_gpu_blocks"])
                stats.page_size = int(s.labels["block_size"])
            else:
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    stats.running = sums["vllm:num_requests_running"]
    stats.waiting = sums["vllm:num_requests_waiting"]
    usage = sums["vllm:kv_cache_usage_perc"]
    stats.kv_usage = usage if math.isfinite(usage) else 0.0
    return stats


@pytest.mark.parametrize("engines,usage", [(1, "0.0"), (2, "0.25"), (4, "0.5"), (2, "NaN")])
def test_agrees_with_prometheus_client(engines: int, usage: str) -> None:
    text = page(engines, usage, bs=128, nb=3000 + engines)
    got = parse_engine_metrics(text)
    assert got == reference(text)
    assert got.running == sum(e + 1 for e in range(engines))  # summed over engines
    assert got.waiting == sum(2 * e + 3 for e in range(engines))  # not the _by_reason series
    assert (got.num_pages, got.page_size) == (3000 + engines, 128)


def test_missing_series_read_as_empty() -> None:
    assert parse_engine_metrics("# nothing here\nprocess_open_fds 3\n") == EngineStats()
    assert parse_engine_metrics("") == EngineStats()


def test_series_without_labels_and_with_timestamps() -> None:
    got = parse_engine_metrics("vllm:num_requests_running 3 1700000000000\n"
                               "vllm:num_requests_waiting   2\n")
    assert (got.running, got.waiting) == (3.0, 2.0)


@pytest.mark.parametrize("line", ['vllm:num_requests_running{engine="0" 1.0',
                                  'vllm:num_requests_waiting{engine="0"}',
                                  "vllm:kv_cache_usage_perc abc"])
def test_malformed_wanted_line_is_a_value_error(line: str) -> None:
    with pytest.raises(ValueError):
        parse_engine_metrics(line + "\n")


def test_non_numeric_cache_config_keeps_the_page_size_unknown() -> None:
    text = CACHE_INFO.replace("{bs}", "None").replace("{nb}", "2048")
    got = parse_engine_metrics(text)
    assert (got.num_pages, got.page_size) == (None, None)


def test_sglang_pages_read_with_sglangs_own_names() -> None:
    """Kind ``sglang``: the series SGLang's collector defines (read from its source, not
    imported: it needs a server), rendered by prometheus_client as SGLang renders them
    (its labels, two DP ranks summed); its cache comes in tokens, pages come later."""
    import importlib.util
    from pathlib import Path

    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    from kvcentric.router.fleet.engine_metrics import SERIES

    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None  # make setup installs SGLang
    src = (Path(spec.origin).parent / "srt" / "observability" /
           "metrics_collector.py").read_text()
    names = SERIES["sglang"]
    for name in (*names.summed, names.cache):
        assert f'name="{name}"' in src, name
    reg = CollectorRegistry()
    labels = ("model_name", "engine_type", "dp_rank")
    values = {names.running: 3, names.waiting: 5, names.kv_usage: 0.25, names.cache: 4096}
    for name, v in values.items():
        g = Gauge(name, name, labels, registry=reg)
        for rank in ("0", "1"):
            g.labels("m", "unified", rank).set(v)
    got = parse_engine_metrics(generate_latest(reg).decode(), "sglang")
    assert got == EngineStats(running=6, waiting=10, kv_usage=0.5, cache_tokens=8192)
    # a vLLM page read as SGLang's has none of its series, and the reverse
    assert parse_engine_metrics(page(), "sglang") == EngineStats()
    assert parse_engine_metrics(generate_latest(reg).decode()) == EngineStats()
