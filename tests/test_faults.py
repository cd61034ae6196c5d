"""The kill matrix, CI-sized (benchmarks/reliability/faults.py): a multi-turn workload through the
router to two vLLM CPU engines with the connector while the local store's coordinator,
one engine, and the Mooncake master are SIGKILLed at half load. Every answer is compared
with a fault-free greedy reference: zero wrong tokens and zero failed requests, and the
cache serves again after each fault (``recovery_s``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.reliability.faults import Workload, matrix
from kvcentric.testing.netns import unavailable_reason

pytestmark = pytest.mark.vllm


def test_reduced_kill_matrix(tmp_path: Path) -> None:
    # Mooncake binds every interface: it runs in a private network namespace. Without one
    # (or without the wheel) the test skips whole, never quietly without the Mooncake row
    # (and under make test that skip fails the run: tests/helpers/skip_policy.py).
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no netns: {reason}")
    pytest.importorskip("mooncake.store", reason="the Mooncake wheel is not installed")
    plan = [("local", "coordinator"), ("local", "engine"), ("mooncake", "master")]
    rows = matrix(plan, Workload(users=3, turns=4), tmp_path)
    assert [(r["backend"], r["fault"]) for r in rows] == plan
    for r in rows:
        assert r["requests"] == 12, r
        assert r["wrong_tokens"] == 0, r
        assert r["failed"] == 0, r
        assert r["recovery_s"] is not None, r  # the cache serves again after the fault
        assert r["hits_after"] is not None and r["hits_after"] > 0.3, r
