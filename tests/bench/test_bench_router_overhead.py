"""bench_router_overhead runs end to end (stub engines, a local store, the router process)
and reports the router's added latency against the direct path measured in the same run;
every request's stream is checked to carry one event per token (the stub streams
``max_tokens`` of them) and ``[DONE]``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.lib.procfs import pin_group
from benchmarks.serving import router_overhead


def test_small_run_reports_both_paths(tmp_path: Path) -> None:
    out = tmp_path / "ro.json"
    assert router_overhead.main(["--requests", "3", "--words", "40,200", "--max-tokens", "5",
                                 "--token-ms", "1", "--engines", "3", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["words"] for r in doc["rows"]] == [40, 200]
    for r in doc["rows"]:
        assert r["router"] == "kvcentric" and r["max_tokens"] == 5
        assert r["requests"] == 3
        assert r["direct_p50_ms"] > 0 and r["router_p50_ms"] > 0
        assert r["router_over_direct"] == r["router_p50_ms"] / r["direct_p50_ms"]
        assert r["router_cpu_ms_per_request"] > 0  # the router process did the work
        passes = r["router_cpu_ms_per_request_passes"]
        assert len(passes) == router_overhead.CPU_PASSES and all(x > 0 for x in passes)
        assert min(passes) <= r["router_cpu_ms_per_request"] <= max(passes)
    assert set(doc["summary"]["added_p50_ms"]) == {"40", "200"}
    assert doc["summary"]["peers"] == {}  # none asked for
    s = doc["summary"]
    assert (s["max_tokens"], s["token_ms"], s["engines"]) == (5, 1.0, 3)
    own = sorted(os.sched_getaffinity(0))
    assert s["router_cpus"] == (own[-1:] if len(own) > 1 else None)


def test_pin_group_binds_every_thread_of_the_group() -> None:
    """The router is pinned after it started its threads: each of them moves."""
    target = {sorted(os.sched_getaffinity(0))[-1]}
    code = ("import threading, time; threading.Thread(target=time.sleep, args=(60,)).start();"
            " print('up', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         start_new_session=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
        tasks = [int(t) for t in os.listdir(f"/proc/{p.pid}/task")]
        assert len(tasks) == 2
        pin_group(p.pid, target)
        assert all(os.sched_getaffinity(t) == target for t in tasks)
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("argv, message", [
    (["--peers", "kvcentric"], "--peers kvcentric: a peer is one of vllm-router:POLICY"),
    (["--max-tokens", "0"], "must be positive"),
    (["--engines", "0"], "must be positive"),
    (["--token-ms", "-1"], "must not be negative"),
])
def test_bad_arguments_are_refused_before_anything_starts(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        router_overhead.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
