"""Under ``make test`` a skipped test is a failure, unless it needs a GPU.

``make test`` (CI) sets ``KVC_NO_SKIPS=1``: then a test or module that skips because
something is missing (a network namespace, the Mooncake wheel, Chromium, a peer router,
disk I/O accounting: what ``make setup`` and ``make peers`` install or the machine must
give) fails the run with the skip's reason, so CI never passes on tests it did not run.
Still allowed: tests marked ``gpu`` (skipped on CPU) and skips whose reason states a fact
about the machine that makes the test moot there ("this machine ...", "this test process
..."). Without the variable (a developer's ``pytest``) skips stay skips.

The hooks are pytest's own; ``tests/conftest.py`` imports them, which registers them.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterable
from typing import Any

import pytest

ENV = "KVC_NO_SKIPS"
MACHINE_FACTS = ("this machine", "this test process")


def enforced() -> bool:
    """Whether skips fail the run (``KVC_NO_SKIPS=1``)."""
    return os.environ.get(ENV, "") not in ("", "0")


def allowed(reason: str, markers: Iterable[str]) -> bool:
    """Whether a skip with ``reason`` of a test with ``markers`` may stay a skip."""
    return "gpu" in set(markers) or reason.strip().lower().startswith(MACHINE_FACTS)


def reason_of(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason a skipped report gives (pytest keeps it as (path, line, 'Skipped: ...'))."""
    lr = report.longrepr
    text = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    return text.removeprefix("Skipped: ")


def enforce(report: pytest.TestReport | pytest.CollectReport, markers: Iterable[str]) -> None:
    """Turn ``report`` into a failure when it is a skip the policy does not allow."""
    if not (enforced() and report.skipped):
        return
    if hasattr(report, "wasxfail"):
        return  # an expected failure, reported as skipped by pytest: not a missing prerequisite
    reason = reason_of(report)
    if allowed(reason, markers):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped under {ENV}=1 (make test): {reason}\n"
                       "make setup / make peers install what the tests need; a skip here "
                       "means CI did not run this test")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]
                              ) -> Generator[None, Any, None]:
    outcome = yield
    enforce(outcome.get_result(), (m.name for m in item.iter_markers()))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    enforce(outcome.get_result(), (m.name for m in collector.iter_markers()))
