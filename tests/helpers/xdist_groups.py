"""How ``make test XDIST="-n 2 --dist loadfile"`` splits the suite over pytest-xdist workers.

Under ``--dist loadfile`` the scheduler below (:func:`pytest_xdist_make_scheduler`) sends
each test module to a worker as one unit, except that these modules together make one
unit, :data:`ENGINES`, run by a single worker in collection order:

- every module that marks a test ``vllm`` (it starts vLLM CPU engines): an engine start
  takes both cores of the CI box, so two at once only slow each other down, and the
  session's plain engine (tests/helpers/engines.py) is then started once, in that worker;
- the modules in :data:`TIMING`, whose tests hold a wall-clock bound (tens of
  milliseconds to a few tenths of a second): they never run while another test of that
  unit starts engines.

Every other module keeps its module-scoped fixtures (made once) and its tests' order, on
whichever worker is free. Most of those tests wait (on subprocesses, sockets, deadlines),
which is why two workers help on two cores.

Why a scheduler and not ``xdist_group`` marks with ``--dist loadgroup``: with pytest 9.2
and pytest-xdist 3.8 loadgroup ignores the marks (xdist renames the test ids to carry the
group, which pytest no longer takes; pytest-xdist issue 1386), so the groups are made here,
on the controller, from the modules' paths and sources.

Without xdist (plain ``make test``, or a plain ``pytest``) nothing here applies.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ENGINES = "engines"
# rootdir-relative: the modules whose bounds a concurrent engine start would break
TIMING = frozenset({
    "tests/store/test_store_hung.py",
    "tests/store/test_store_mooncake_hung.py",
    "tests/bench/test_emulator.py",
    "tests/bench/test_procfs.py",
    "tests/connector/test_models.py",
})
_VLLM_MARK = re.compile(r"\bpytest\.mark\.vllm\b")


@cache
def unit_of(module: str, rootdir: Path) -> str:
    """The scheduling unit of ``module`` (a rootdir-relative path): :data:`ENGINES` for an
    engine or timing module, else the module itself."""
    if module in TIMING:
        return ENGINES
    try:
        source = (rootdir / module).read_text(errors="replace")
    except OSError:
        return module
    return ENGINES if _VLLM_MARK.search(source) else module


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with :data:`ENGINES` as one unit (other modes: xdist's own)."""
    if config.getoption("dist", "no") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling  # only under xdist

    rootdir = config.rootpath

    class EngineUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid.split("::", 1)[0], rootdir)

    return EngineUnitScheduling(config, log)
