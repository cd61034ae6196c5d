"""tests/helpers/xdist_groups.py: how make test's parallel pass pins its workers' engines,
keeps every engine module on one worker and orders its units, and that the serial pass
has what it is for."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.xdist_groups import (
    BIND_ENV,
    ENGINE_MODULES,
    ENGINE_UNIT,
    LONGEST_FIRST,
    SERIAL_MODULES,
    bind_worker,
    longest_first,
    stray_serial_tests,
    unit_of,
)

ROOT = Path(__file__).resolve().parents[1]
SERIAL_MARK = re.compile(r"\bpytest\.mark\.serial\b")
# the modules whose every test is serial
WHOLLY_SERIAL = ("tests/store/test_store_hung.py", "tests/store/test_store_mooncake_hung.py",
                 "tests/store/test_store_mooncake.py", "tests/bench/test_emulator.py",
                 "tests/bench/test_procfs.py")


def test_each_worker_pins_its_engines_to_a_core_of_its_own() -> None:
    got = {}
    for worker in ("gw0", "gw1", "gw2"):
        env = {"PYTEST_XDIST_WORKER": worker}
        bind_worker(env, cores=[3, 5])
        got[worker] = env[BIND_ENV]
    assert got == {"gw0": "3", "gw1": "5", "gw2": "3"}


def test_a_binding_already_set_or_no_worker_is_left_alone() -> None:
    env = {"PYTEST_XDIST_WORKER": "gw1", BIND_ENV: "0|1"}
    bind_worker(env, cores=[0, 1])
    assert env[BIND_ENV] == "0|1"
    plain: dict[str, str] = {}
    bind_worker(plain, cores=[0, 1])
    assert plain == {}


def test_the_longest_modules_go_first_the_rest_keep_their_order() -> None:
    rest = ["tests/a/test_x.py", "tests/b/test_y.py"]
    modules = [rest[0], LONGEST_FIRST[2], rest[1], LONGEST_FIRST[0]]
    assert longest_first(modules) == [LONGEST_FIRST[0], LONGEST_FIRST[2], *rest]


def test_every_named_module_exists() -> None:
    named = [m for m in (*LONGEST_FIRST, *ENGINE_MODULES, *SERIAL_MODULES) if m != ENGINE_UNIT]
    missing = [m for m in named if not (ROOT / m).is_file()]
    assert not missing, f"xdist_groups names modules that are gone: {missing}"


# what makes a module start engines: the vllm mark, or the session's plain engine pool
ENGINE_USE = re.compile(r"\bpytest\.mark\.vllm\b|\bplain_tiny\b|\bengine_pool\b")


def test_every_engine_module_runs_in_the_engine_unit() -> None:
    """Every test module that starts vLLM engines is in ENGINE_MODULES (so the parallel
    pass never starts engines on both workers at once), and each of those does."""
    found = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if ENGINE_USE.search(p.read_text()))
    assert found == sorted(ENGINE_MODULES)
    assert unit_of("tests/e2e/test_faults.py::test_reduced_kill_matrix") == ENGINE_UNIT
    assert unit_of("tests/connector/test_vllm_tp.py::test_x[a::b]") == ENGINE_UNIT
    assert unit_of("tests/store/test_store_local.py::test_x") == "tests/store/test_store_local.py"


def test_the_serial_pass_collects_the_timing_and_stress_tests() -> None:
    """What make test's second pass collects (`-m serial` over SERIAL_MODULES): the
    modules that hold tight wall-clock bounds and the tests that load both cores, and
    no module that starts an engine (the engines belong to the parallel pass) but the
    fault rows, whose TTFT bounds compare batches measured moments apart
    (tests/helpers/xdist_groups.py)."""
    modules = subprocess.run([sys.executable, "-m", "tests.helpers.xdist_groups"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    assert modules == list(SERIAL_MODULES)  # what the Makefile passes
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", "-m", "serial", *modules],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ids = [ln for ln in r.stdout.splitlines() if "::" in ln]
    files = {i.split("::", 1)[0] for i in ids}
    assert files == set(SERIAL_MODULES)  # each holds a serial test
    assert set(WHOLLY_SERIAL) <= files
    assert "tests/store/test_store_local.py::test_multiprocess_stress" in ids
    assert "tests/connector/test_models.py::test_idempotent_call_is_fast" in ids
    sglang = [i for i in ids if "test_sglang_backend" in i]
    assert sglang and all("[mooncake" in i for i in sglang)  # its local-store cases: not
    vllm = re.compile(r"\bpytest\.mark\.vllm\b")
    assert [f for f in files if vllm.search((ROOT / f).read_text())] == [
        "tests/e2e/test_faults.py"]


def test_every_module_with_a_serial_test_is_in_the_serial_pass() -> None:
    """A module that marks a test serial and is not in SERIAL_MODULES would run in
    neither pass: the source says which modules mark tests serial, and a run that
    collects a stray serial test is refused."""
    found = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if SERIAL_MARK.search(p.read_text()))
    assert found == sorted(SERIAL_MODULES)

    class Item:
        def __init__(self, nodeid: str, serial: bool) -> None:
            self.nodeid, self.serial = nodeid, serial

        def get_closest_marker(self, name: str) -> object | None:
            return object() if name == "serial" and self.serial else None

    items = [Item(f"{SERIAL_MODULES[0]}::test_a", True),
             Item("tests/store/test_store_pins.py::test_b", False),
             Item("tests/store/test_store_pins.py::test_c[x::y]", True)]
    assert stray_serial_tests(items) == ["tests/store/test_store_pins.py::test_c[x::y]"]
    from tests.helpers.xdist_groups import pytest_collection_modifyitems
    with pytest.raises(pytest.UsageError, match="test_store_pins.py::test_c"):
        pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
