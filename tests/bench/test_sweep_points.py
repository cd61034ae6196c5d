"""A capacity sweep's saved points (benchmarks.serving.sweep_points): an interrupted sweep
resumes from them, a file of another run is refused, a torn last line runs again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.lib import capacity as cap
from benchmarks.serving import slo_capacity
from benchmarks.serving.sweep_points import SavedPoints
from tests.bench.test_slo_capacity import _doc
from tests.helpers.waiting import wait_until

KEY = {"version": 1, "args": {"workload": "hotprefix", "seed": 0}, "cfg": {}, "git": {}}


class _Engine:
    """Holds up to 5 req/s; records every point it runs and, as the emulated fleet does,
    a run and a request row per point; ``fail_after`` points, it dies (a killed sweep)."""

    arms = ["a", "b"]

    def __init__(self, fail_after: int | None = None) -> None:
        self.ran: list[tuple[str, float, int]] = []
        self.fail_after = fail_after
        self.runs: list[dict[str, Any]] = []
        self.request_log: list[dict[str, Any]] = []

    def point(self, arm: str, rate: float, rep: int
              ) -> tuple[dict[str, Any], list[cap.Served]]:
        if self.fail_after is not None and len(self.ran) == self.fail_after:
            raise KeyboardInterrupt
        self.ran.append((arm, rate, rep))
        self.runs.append({"arm": arm, "rate": rate, "rep": rep})
        self.request_log.append({"arm": arm, "rate": rate, "rep": rep, "ttft": rate / 10})
        frac = 1.0 if rate <= (5.0 if arm == "a" else 3.0) else 0.5
        return ({"offered_rps": rate, "effective_fraction": frac},
                [cap.Served(rate / 10, 0.01 * rep, 100, 10, 20),
                 cap.Served(None, 0.0, 50, rejected=True)])


def _sweep(engine: Any) -> slo_capacity.Sweep:
    sw = slo_capacity.Sweep(engine, reps=3, fixed=True, max_rates=14,
                            progress=lambda _: None, sweep_reps=1)
    sw.run([1.0, 2.0, 4.0, 8.0])
    sw.confirm()
    return sw


def test_an_interrupted_sweep_resumes_from_its_saved_points(tmp_path: Path) -> None:
    path = tmp_path / "points.jsonl"
    whole = _Engine()
    expect = _sweep(whole)
    first = _Engine(fail_after=5)
    killed = SavedPoints(first, path, KEY)
    with pytest.raises(KeyboardInterrupt):
        _sweep(killed)
    killed.close()  # what the killed process's exit does
    second = _Engine()
    saved = SavedPoints(second, path, KEY)
    assert len(saved.saved) == 5
    sw = _sweep(saved)
    # only the points the first process did not finish ran again, none twice
    assert sorted(first.ran + second.ran) == sorted(whole.ran)
    assert saved.reused == 5
    for arm in whole.arms:
        assert sw.arm(arm) == expect.arm(arm)
    # the engine's per-run records hold every point once, reused or run
    assert sorted(map(str, second.runs)) == sorted(map(str, whole.runs))
    assert sorted(map(str, second.request_log)) == sorted(map(str, whole.request_log))
    # outcomes come back as they went in
    row, outs = saved.point("a", 1.0, 0)
    assert outs == [cap.Served(0.1, 0.0, 100, 10, 20), cap.Served(None, 0.0, 50, rejected=True)]
    assert row == {"offered_rps": 1.0, "effective_fraction": 1.0}
    assert len(second.runs) == len(whole.runs)  # given out again: not recorded twice
    saved.close()


def test_a_file_of_another_run_or_of_something_else_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "points.jsonl"
    saved = SavedPoints(_Engine(), path, KEY)
    saved.point("a", 1.0, 0)
    saved.close()
    other = {**KEY, "args": {"workload": "hotprefix", "seed": 1}}
    with pytest.raises(ValueError, match=r"saved by another run \(differs in args.seed\)"):
        SavedPoints(_Engine(), path, other)
    junk = tmp_path / "junk.jsonl"
    junk.write_text("hello\n")
    with pytest.raises(ValueError, match="not a sweep's saved points"):
        SavedPoints(_Engine(), junk, KEY)
    # a damaged line inside the file is not silently skipped
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{", lines[1]]) + "\n")
    with pytest.raises(ValueError, match="line 2 is not a saved point"):
        SavedPoints(_Engine(), path, KEY)


def test_a_file_in_use_by_another_sweep_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "points.jsonl"
    first = SavedPoints(_Engine(), path, KEY)
    with pytest.raises(ValueError, match="another sweep is using it"):
        SavedPoints(_Engine(), path, KEY)
    first.close()
    SavedPoints(_Engine(), path, KEY).close()  # free once the first let it go


def test_a_torn_last_line_is_cut_and_its_point_runs_again(tmp_path: Path) -> None:
    path = tmp_path / "points.jsonl"
    saved = SavedPoints(_Engine(), path, KEY)
    saved.point("a", 1.0, 0)
    saved.point("a", 2.0, 0)
    saved.close()
    data = path.read_bytes()
    path.write_bytes(data[:-40])  # the writer died in the middle of its last append
    eng = _Engine()
    again = SavedPoints(eng, path, KEY)
    assert list(again.saved) == [("a", 1.0, 0)]
    again.point("a", 2.0, 0)
    assert eng.ran == [("a", 2.0, 0)]
    assert [json.loads(x).get("rate") for x in path.read_text().splitlines()] == [None, 1.0, 2.0]
    again.close()


def test_a_simulated_sweep_killed_by_sigkill_resumes_to_the_same_result(tmp_path: Path) -> None:
    """The real command, killed with SIGKILL once it has saved points, then run again."""
    args = ["--reps", "2", "--arms", "round_robin,kvcentric", "--start-rates", "2"]
    whole = _doc(tmp_path, *args)
    path = tmp_path / "points.jsonl"
    out = tmp_path / "resumed.json"
    cmd = [sys.executable, "-m", "benchmarks.serving.slo_capacity", "hotprefix",
           "--instances", "4", "--requests", "400", "--out", str(out),
           "--checkpoint", str(path), *args]
    root = Path(slo_capacity.__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        def saved_or_ended() -> bool:
            return proc.poll() is not None or (
                path.exists() and path.read_bytes().count(b"\n") >= 3)

        assert wait_until(saved_or_ended, 120), "no point saved within 120 s"
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    assert not out.exists()
    assert slo_capacity.main(["hotprefix", "--instances", "4", "--requests", "400",
                              "--out", str(out), "--checkpoint", str(path), *args]) == 0
    doc = json.loads(out.read_text())
    assert any("taken from points.jsonl" in n for n in doc["notes"])
    for a, b in zip(doc["arms"], whole["arms"]):
        assert a["summary"] == b["summary"] and a["rows"] == b["rows"]
    assert doc["summary"]["capacity_rps"] == whole["summary"]["capacity_rps"]
