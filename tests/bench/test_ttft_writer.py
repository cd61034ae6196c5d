"""``python -m benchmarks.serving.ttft --writer``'s statistics (benchmarks/serving/ttft_writer.py):
every prompt reaches every arm back to back in a rotating order, overheads are paired per
round, and each connector arm's saves are read from its own counters (ours from our
connector's, LMCache's from its server's, as benchmarks/serving/work.py reads them): an
arm that saved nothing is invalid."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest

from benchmarks.serving import ttft_writer, work
from benchmarks.serving.ttft_writer import RoundTimes
from kvcentric.testing.servers import VllmServer


class _Arm:
    """An arm's test double for time_round: what it saves per prompt sent to it
    (``per_prompt`` blocks or chunks), and the log of (arm, prompt) in send order. Like
    the real arms it keeps its count where the real one does: ours on its vLLM's
    ``/metrics`` under our connector's counter; LMCache's vLLM exports none of ours (its
    ``/metrics`` has only vLLM's own), its server counts LMCache's chunks."""

    def __init__(self, name: str, log: list[tuple[str, int]], per_prompt: float) -> None:
        self.name, self.log, self.per_prompt, self.saved = name, log, per_prompt, 0.0

    def metrics(self) -> dict[str, float]:  # what its vLLM's /metrics says
        own = {"vllm:prompt_tokens_total": 1.0}
        return own | ({work.OURS[0]: self.saved} if self.name == "kvc" else {})

    def server_metrics(self) -> str:  # an lmcache server's /metrics (OpenTelemetry names)
        return ("# TYPE lmcache_mp_l1_write_chunks_total counter\n"
                f'lmcache_mp_l1_write_chunks_total{{salt="a"}} {self.saved / 2}\n'
                f'lmcache_mp_l1_write_chunks_total{{salt="b"}} {self.saved / 2}\n'
                "lmcache_mp_l1_read_chunks_total 0\n")


def _readers(arms: dict[str, _Arm]) -> dict[str, Any]:
    kvc, lmc = arms["kvc"], arms["lmcache"]
    return {"kvc": lambda: work.ours(kvc.metrics(), 128),
            "lmcache": lambda: work.lmcache(work.prometheus_sums(lmc.server_metrics()), 256)}


def test_every_prompt_goes_to_every_arm_back_to_back_in_rotating_order() -> None:
    log: list[tuple[str, int]] = []
    arms = {n: _Arm(n, log, 32.0) for n in ("plain", "kvc", "lmcache")}

    def ttft(server: Any, prompt: list[int]) -> float:
        log.append((server.name, prompt[0]))
        server.saved += server.per_prompt
        return {"plain": 1.0, "kvc": 1.02, "lmcache": 1.05}[server.name] * (1 + prompt[0])

    servers = cast(dict[str, VllmServer], arms)
    got = ttft_writer.time_round(servers, [[0], [1], [2]], turn=1, ttft=ttft,
                                 work=_readers(arms))
    assert log == [("kvc", 0), ("lmcache", 0), ("plain", 0),
                   ("lmcache", 1), ("plain", 1), ("kvc", 1),
                   ("plain", 2), ("kvc", 2), ("lmcache", 2)]
    assert got.first == {"plain": 1.0, "kvc": 1.02, "lmcache": 1.05}
    assert got.steady["kvc"] == [pytest.approx(2.04), pytest.approx(3.06)]
    # read before and after, each from its own counters, in tokens
    assert {a: w.saved for a, w in got.work.items()} == {"kvc": 96 * 128, "lmcache": 96 * 256}
    assert got.work["lmcache"].source == "the lmcache server's counters"
    assert work.OURS[0] not in arms["lmcache"].metrics()  # LMCache's vLLM exports none of ours


def test_an_arm_that_saved_nothing_is_invalid_and_left_out_of_the_table() -> None:
    log: list[tuple[str, int]] = []
    arms = {"plain": _Arm("plain", log, 0.0), "kvc": _Arm("kvc", log, 8.0),
            "lmcache": _Arm("lmcache", log, 0.0)}  # its server stored nothing

    def ttft(server: Any, prompt: list[int]) -> float:
        server.saved += server.per_prompt
        return 1.0

    servers = cast(dict[str, VllmServer], arms)
    rounds = [ttft_writer.time_round(servers, [[0], [1]], turn=t, ttft=ttft,
                                     work=_readers(arms)) for t in range(2)]
    row = ttft_writer.overheads(rounds, 1024)
    assert row["lmcache_saved"] == [0.0, 0.0] and "kvc_invalid" not in row
    assert row["lmcache_invalid"].startswith("a round saved nothing by the lmcache server's")
    text = ttft_writer.table([row])
    assert "lmcache INVALID: a round saved nothing" in text and text.count("kvc") == 1


def _round(plain_first: float, kvc_first: float, plain: list[float],
           kvc: list[float]) -> RoundTimes:
    return RoundTimes(first={"plain": plain_first, "kvc": kvc_first},
                      steady={"plain": plain, "kvc": kvc},
                      work={"kvc": work.Work(1024.0, 0.0, "tokens", "ours")})


def test_overhead_is_the_median_of_paired_ratios_and_drift_cancels() -> None:
    # round 2 ran on a slow box (+30% for both arms): its pair still says +2%
    rounds = [_round(1.00, 1.01, [1.0, 1.0, 1.0], [1.01, 1.03, 1.00]),
              _round(1.30, 1.326, [1.3, 1.3, 1.3], [1.3, 1.313, 1.3]),
              _round(1.00, 1.03, [1.0, 1.1, 1.0], [1.0, 1.1, 1.01])]
    row = ttft_writer.overheads(rounds, 4096)
    assert row["kvc_first_overhead"] == pytest.approx(0.02)
    assert row["kvc_first_overhead_rounds"] == pytest.approx([0.01, 0.02, 0.03])
    assert row["kvc_first_overhead_q1_q3"] == pytest.approx([0.015, 0.025])
    assert row["kvc_steady_overhead_rounds"] == pytest.approx([0.01, 0.0, 0.0])
    assert row["kvc_steady_overhead"] == pytest.approx(0.0)
    # the unpaired ratio of medians mixes rounds: 1.03 / 1.00
    assert row["kvc_first_overhead_unpaired"] == pytest.approx(0.03)
    assert row["plain_first_ms"] == pytest.approx([1000.0, 1300.0, 1000.0])
    assert row["kvc_saved"] == [1024.0, 1024.0, 1024.0] and "kvc_invalid" not in row
    assert "plain_first_overhead" not in row


def test_table_and_plot(tmp_path: Path) -> None:
    rows = [ttft_writer.overheads([_round(1.0, 1.04, [1.0], [1.01]),
                                   _round(1.0, 1.06, [1.0], [1.03])], n) for n in (1024, 4096)]
    text = ttft_writer.table(rows)
    assert "  +5.0% [ +4.5, +5.5]" in text and "+2.0% [ +1.5, +2.5]" in text
    assert text.count("kvc") == 2
    png = ttft_writer.plot(rows, tmp_path / "w.png", {1024: 0.05, 4096: 0.02})
    assert png.read_bytes()[:4] == b"\x89PNG"
    json.dumps(rows)  # the rows go into the results JSON as they are
