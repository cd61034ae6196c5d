"""How ``make test`` runs the suite: a parallel first pass, then a serial pass.

``make test`` runs pytest twice (Makefile):

1. ``-m "not serial"`` on two pytest-xdist workers (``XDIST="-n 2 --dist loadfile"``, the
   default; ``make test XDIST=`` runs it in one process). :func:`pytest_xdist_make_scheduler`
   makes every module of :data:`ENGINE_MODULES` (those that start vLLM engines) one unit,
   ``engines``, sent whole to one worker and handed out first: that worker starts the
   session's engines one test at a time, as a one-process run would, while the other
   worker takes the other modules, each a unit of its own, longest first
   (:data:`LONGEST_FIRST`). Two workers' engine starts never meet: on the 2-core box they
   contended for the cores and the memory instead of overlapping. Each worker has its
   own session: its own plain engine pool (tests/helpers/engines.py), zygote and Mooncake
   namespace. :func:`bind_worker` pins each worker's engines to a core of their own. A
   third worker made the pass longer, not shorter (more contention than idle to fill).
2. ``-m serial``: one process, nothing else running. A module or test is ``serial`` when it
   holds a wall-clock bound a concurrent engine start breaks (tens of milliseconds to a few
   tenths of a second), or when it loads the box so hard that another test's bound
   breaks beside it (the store stress tests; the Mooncake store's put and set tests, whose
   transfers failed next to them). The one engine module here is tests/e2e/test_faults.py:
   its stop rows hold a stopped store's batch to a miss's TTFT measured moments apart,
   which the other worker's load skews. Each marks itself with ``pytest.mark.serial``, and its
   module is in :data:`SERIAL_MODULES`: the serial pass collects those modules only
   (``python -m tests.helpers.xdist_groups`` prints them for the Makefile), since
   collecting all of them imports vLLM and rewrites every test module's asserts for
   nothing. :func:`pytest_collection_modifyitems` fails any run that collects a
   ``serial`` test outside them, which neither pass would run.

Without xdist (``make test XDIST=``, or a plain ``pytest``) the scheduler and the binding
do not apply, and a plain ``pytest`` runs serial and other tests together in one process.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, MutableMapping, Sequence
from typing import Any

import pytest

# rootdir-relative: the modules whose tests start vLLM engines (``pytest.mark.vllm``, or the
# session's plain engine pool), run as one unit (ENGINE_UNIT) on one worker;
# tests/test_suite_plan.py checks that every module with such a test is named here
ENGINE_MODULES = (
    "tests/connector/test_vllm_hma.py",
    "tests/e2e/test_faults.py",
    "tests/connector/test_vllm_connector.py",
    "tests/connector/test_vllm_tp.py",
    "tests/e2e/test_router_e2e.py",
    "tests/test_doctor_engine.py",
    "tests/router/test_router_fuzz_engine.py",
    "tests/connector/test_vllm_mooncake.py",
    "tests/connector/test_vllm_disk.py",
    "tests/connector/test_vllm_inputs.py",
    "tests/bench/test_bench_serving.py",
    "tests/e2e/test_observability.py",
    "tests/bench/test_bench_serving_tokenizers.py",
    "tests/test_zygote.py",
)
ENGINE_UNIT = "engines"
# the other units, longest first (build/junit.xml of a full run, rendered by
# `python -m benchmarks.lib.durations`); units not named here follow in collection order
LONGEST_FIRST = (
    ENGINE_UNIT,
    "tests/test_install.py",
    "tests/test_doctor.py",
    "tests/store/test_store_mooncake.py",
    "tests/connector/test_sglang_backend.py",
    "tests/router/test_router_fuzz.py",
    "tests/test_packaging.py",
    "tests/bench/test_slo_capacity.py",
    "tests/store/test_store_local.py",
    "tests/store/test_store_disk.py",
    "tests/router/test_router_replicas.py",
)
# rootdir-relative: every module with a test marked ``serial`` (the serial pass collects
# these only; pytest_collection_modifyitems fails a run with a serial test elsewhere)
SERIAL_MODULES = (
    "tests/bench/test_emulator.py",
    "tests/bench/test_procfs.py",
    "tests/bench/test_slo_capacity.py",
    "tests/connector/test_models.py",
    "tests/connector/test_sglang_backend.py",
    "tests/e2e/test_faults.py",
    "tests/store/test_store_disk.py",
    "tests/store/test_store_hung.py",
    "tests/store/test_store_local.py",
    "tests/store/test_store_mooncake.py",
    "tests/store/test_store_mooncake_hung.py",
)
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def bind_worker(environ: MutableMapping[str, str], cores: Sequence[int] | None = None) -> None:
    """Pin the OpenMP threads of the engines xdist worker ``gwN`` starts to the
    ``N``-th (mod their number) of ``cores`` (default: the cores this process may run
    on), through ``environ``, which its engines inherit.

    Unpinned, vLLM's CPU worker binds itself to the first core it finds free in its own
    view, and two engines of two workers both pick core 0 while core 1 waits. A test that
    sets its own binding (the TP=2 tests: one core per rank) keeps it; outside xdist, or
    where the operator set a binding, nothing changes."""
    worker = environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or BIND_ENV in environ:
        return
    allowed = sorted(cores if cores is not None else os.sched_getaffinity(0))
    environ[BIND_ENV] = str(allowed[int(worker[2:]) % len(allowed)])


def stray_serial_tests(items: Iterable[pytest.Item]) -> list[str]:
    """The ids of the ``serial`` tests among ``items`` whose module is not in
    :data:`SERIAL_MODULES` (neither pass would run them)."""
    return [i.nodeid for i in items if i.get_closest_marker("serial") is not None
            and i.nodeid.split("::", 1)[0] not in SERIAL_MODULES]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a run that collects a ``serial`` test outside :data:`SERIAL_MODULES`."""
    stray = stray_serial_tests(items)
    if stray:
        raise pytest.UsageError(
            "tests marked serial outside SERIAL_MODULES (tests/helpers/xdist_groups.py; "
            f"make test's serial pass would never collect them): {stray[:5]}")


def unit_of(nodeid: str) -> str:
    """The unit of the parallel pass that test ``nodeid`` belongs to: :data:`ENGINE_UNIT`
    for a test of an engine module, else its module."""
    module = nodeid.split("::", 1)[0]
    return ENGINE_UNIT if module in ENGINE_MODULES else module


def longest_first(units: Iterable[str]) -> list[str]:
    """``units`` in the order the parallel pass hands them out: those of
    :data:`LONGEST_FIRST` in its order, then the others in their given order."""
    rank = {m: i for i, m in enumerate(LONGEST_FIRST)}
    return sorted(units, key=lambda m: rank.get(m, len(rank)))  # stable


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with the units of :func:`unit_of` (the engine modules one unit),
    longest first (other modes: xdist's own)."""
    if config.getoption("dist", "no") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling  # only under xdist

    class EnginesTogetherScheduling(LoadScopeScheduling):
        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if not self._ordered:  # the queue is complete before the first assignment
                units = dict(self.workqueue)
                self.workqueue.clear()
                self.workqueue.update((m, units[m]) for m in longest_first(units))
                self._ordered = True
            super()._assign_work_unit(node)

    return EnginesTogetherScheduling(config, log)


if __name__ == "__main__":
    print(" ".join(SERIAL_MODULES))
