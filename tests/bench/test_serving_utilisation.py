"""benchmarks/serving/utilisation.py: per-instance load sampled from /metrics (a real HTTP
server that plays scripted gauges), its statistics, the box plot and the report table."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from benchmarks.serving import report
from benchmarks.serving.utilisation import boxes
from kvcentric.bench_serving import utilisation
from kvcentric.testing.servers import free_port
from tests.helpers.waiting import wait_until


def _row(running: list[Any], waiting: list[Any], kv: list[Any]) -> dict[str, list[Any]]:
    return {"t_s": [float(i) for i in range(len(running))], "running": running,
            "waiting": waiting, "kv_usage": kv}


def test_statistics_of_samples() -> None:
    busy = _row([0, 1, 2, 0, None], [0, 0, 3, 1, None], [0.1, 0.2, 0.6, 0.3, None])
    idle = _row([0, 0, 0, 0], [0, 0, 0, 0], [None] * 4)  # e.g. a server without KV gauge
    u = utilisation.summarise({"a": busy, "b": idle}, 0.5)
    a, b = u["per_instance"]["a"], u["per_instance"]["b"]
    assert (a["samples"], a["answered"]) == (5, 4)
    assert a["busy_fraction"] == pytest.approx(3 / 4)  # loads 0, 1, 5, 1
    assert a["load_mean"] == pytest.approx(7 / 4) and a["running_mean"] == pytest.approx(3 / 4)
    assert (a["waiting_mean"], a["waiting_max"]) == (pytest.approx(1.0), 3)
    assert (a["kv_usage_mean"], a["kv_usage_max"]) == (pytest.approx(0.3), 0.6)
    assert b["busy_fraction"] == 0.0 and b["kv_usage_mean"] is None
    assert u["load_imbalance"] == pytest.approx((7 / 4) / (7 / 8))  # busiest over the mean
    both_idle = utilisation.summarise({"b": idle}, 0.5)
    assert both_idle["load_imbalance"] is None
    text = utilisation.format_table(u)
    assert "75%" in text and "load imbalance (max / mean): 2.00" in text


class _Gauges(BaseHTTPRequestHandler):
    """/metrics: running = the number of scrapes so far, waiting 2, KV usage 0.25."""

    calls = 0

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        type(self).calls += 1
        body = (f'vllm:num_requests_running{{engine="0"}} {self.calls}\n'
                'vllm:num_requests_waiting{engine="0"} 2.0\n'
                'vllm:kv_cache_usage_perc{engine="0"} 0.25\n').encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_sampler_polls_every_url_and_keeps_the_run_window(tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("G", (_Gauges,), {"calls": 0}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    up = f"http://127.0.0.1:{server.server_address[1]}"
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    try:
        with utilisation.Sampler([up, down], interval_s=0.05) as s:
            # entered only once the first round is in: a run starting now is sampled at once
            assert s.samples[up]["t_s"] and s.samples[down]["t_s"]

            def after(more: int) -> None:
                """Until ``more`` rounds past the present are in (one may be in flight)."""
                n = len(s.samples[up]["t_s"])
                assert wait_until(lambda: len(s.samples[up]["t_s"]) >= n + more, 30)

            after(2)  # rounds before the window
            t0 = time.perf_counter()
            after(4)  # at least 3 inside it
            t1 = time.perf_counter()
            after(2)  # and after it
    finally:
        server.shutdown()
        server.server_close()
    got = s.samples[up]
    assert len(got["t_s"]) >= 8 and got["running"][:3] == [1.0, 2.0, 3.0]
    assert set(got["waiting"]) == {2.0} and set(got["kv_usage"]) == {0.25}
    assert set(s.samples[down]["running"]) == {None} and s.samples[down]["t_s"]
    win = s.window(t0, t1)
    assert 3 <= len(win[up]["t_s"]) < len(got["t_s"])
    assert all(0 <= t <= t1 - t0 for t in win[up]["t_s"])
    u = utilisation.summarise(win, 0.05)
    assert u["per_instance"][up]["busy_fraction"] == 1.0
    assert u["per_instance"][down]["answered"] == 0 and u["per_instance"][down]["load_mean"] is None
    with pytest.raises(ValueError):
        utilisation.Sampler([up], interval_s=0)


def test_box_plot_and_report_table(tmp_path: Path) -> None:
    def arm(label: str, loads: list[int]) -> dict[str, Any]:
        rows = {f"http://x/{i}": _row(loads, [0] * len(loads), [0.5] * len(loads))
                for i in range(2)}
        return {"label": label, "utilisation_samples": rows,
                "utilisation": utilisation.summarise(rows, 0.5)}

    results = [arm("round-robin", [0, 1, 2]), arm("ours", [1, 1, 1])]
    path = boxes(results, tmp_path / "u.png", "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = report.utilisation_table(results)
    assert len([x for x in lines if x.startswith("| round-robin |")]) == 2
    assert "| ours | 1 | 100% | 1.00 | 0.00 (0) | 50% (50%) | 1.00 |" in lines
    assert report.utilisation_table([{"label": "old", "summary": {}}]) == []
