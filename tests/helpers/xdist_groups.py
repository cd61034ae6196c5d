"""How ``make test`` runs the suite: a first pass (parallel on request), then a serial pass.

``make test`` runs pytest twice (Makefile):

1. ``-m "not serial"``, in one process by default. With ``XDIST="-n 2 --dist loadfile"``
   (not yet the default: on the 2-core box two workers' engine starts contend for the
   cores and the memory rather than overlap): two pytest-xdist workers, each test module a
   unit sent whole to one worker (its module-scoped fixtures made once, its tests in their
   order). :func:`pytest_xdist_make_scheduler` hands out the
   longest modules first (:data:`LONGEST_FIRST`), so that no long engine module starts
   last and leaves the other worker idle while it runs. Each worker has its own session:
   its own plain engine pool (tests/helpers/engines.py) and Mooncake namespace.
   :func:`bind_worker` pins each worker's engines to a core of their own.
2. ``-m serial``: one process, nothing else running. A module or test is ``serial`` when it
   holds a wall-clock bound a concurrent engine start breaks (tens of milliseconds to a few
   tenths of a second), or when it loads the box so hard that another test's bound
   breaks beside it (the store stress tests; the Mooncake store's put and set tests, whose
   transfers failed next to them). Each marks itself with ``pytest.mark.serial``.

Without xdist (plain ``make test``, or a plain ``pytest``) the scheduler and the binding
do not apply, and a plain ``pytest`` runs serial and other tests together in one process.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, MutableMapping, Sequence
from typing import Any

import pytest

# rootdir-relative, longest first (build/junit.xml of a full run, rendered by
# `python -m benchmarks.lib.durations`); modules not named here follow in collection order
LONGEST_FIRST = (
    "tests/connector/test_vllm_hma.py",
    "tests/connector/test_vllm_connector.py",
    "tests/e2e/test_faults.py",
    "tests/e2e/test_router_e2e.py",
    "tests/test_install.py",
    "tests/test_doctor_engine.py",
    "tests/connector/test_vllm_tp.py",
    "tests/router/test_router_fuzz.py",
    "tests/connector/test_vllm_mooncake.py",
    "tests/connector/test_vllm_disk.py",
    "tests/test_packaging.py",
    "tests/connector/test_vllm_inputs.py",
    "tests/bench/test_bench_serving.py",
    "tests/e2e/test_observability.py",
    "tests/bench/test_bench_serving_tokenizers.py",
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


def longest_first(modules: Iterable[str]) -> list[str]:
    """``modules`` in the order the parallel pass hands them out: those of
    :data:`LONGEST_FIRST` in its order, then the others in their given order."""
    rank = {m: i for i, m in enumerate(LONGEST_FIRST)}
    return sorted(modules, key=lambda m: rank.get(m, len(rank)))  # stable


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, the modules of :data:`LONGEST_FIRST` handed out first (other
    modes: xdist's own)."""
    if config.getoption("dist", "no") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling  # only under xdist

    class LongestFirstScheduling(LoadScopeScheduling):
        _ordered = False

        def _assign_work_unit(self, node: Any) -> None:
            if not self._ordered:  # the queue is complete before the first assignment
                units = dict(self.workqueue)
                self.workqueue.clear()
                self.workqueue.update((m, units[m]) for m in longest_first(units))
                self._ordered = True
            super()._assign_work_unit(node)

    return LongestFirstScheduling(config, log)
