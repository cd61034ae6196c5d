"""benchmarks/lib/durations.py: the table of a junit XML that pytest itself wrote (make
test's build/junit.xml) lists the slowest tests by their pytest ids, in order, with the
run's totals; the same file gives the same bytes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.lib import durations

SUITE = '''
import pytest

from tests.helpers.waiting import wait_until


def test_fast():
    pass


def test_slow():
    # a known minimum duration: a poll that only ends at its deadline
    assert not wait_until(lambda: False, 0.3)


class TestGroup:
    @pytest.mark.parametrize("n", [1, 2])
    def test_param(self, n):
        assert n


def test_fails():
    assert False


@pytest.mark.skip(reason="shown as skipped")
def test_skipped():
    pass
'''


@pytest.fixture(scope="module")
def junit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("junit")
    pkg = d / "tests" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "test_demo.py").write_text(SUITE)
    out = d / "junit.xml"
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"--rootdir={d}", f"--junitxml={out}", str(pkg / "test_demo.py")],
                       cwd=d, capture_output=True, text=True,
                       env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1, r.stdout + r.stderr  # test_fails fails, by design
    return out


def test_the_table_of_a_pytest_junit(junit: Path) -> None:
    run = durations.parse(junit)
    ids = {c.nodeid: c for c in run.cases}
    slow = "tests/demo/test_demo.py::test_slow"
    assert set(ids) == {"tests/demo/test_demo.py::test_fast", slow,
                        "tests/demo/test_demo.py::TestGroup::test_param[1]",
                        "tests/demo/test_demo.py::TestGroup::test_param[2]",
                        "tests/demo/test_demo.py::test_fails",
                        "tests/demo/test_demo.py::test_skipped"}
    assert ids[slow].seconds >= 0.3 and ids[slow].outcome == "passed"
    assert ids["tests/demo/test_demo.py::test_fails"].outcome == "failed"
    assert ids["tests/demo/test_demo.py::test_skipped"].outcome == "skipped"
    assert run.wall_s >= ids[slow].seconds and run.hostname

    text = durations.render(run, top=3, files=5)
    assert text.startswith("6 tests: 4 passed, 1 failed, 1 skipped; wall ")
    assert f"\n| 1 | `{slow}` | {ids[slow].seconds:.2f} | " in text  # the slowest first
    rows = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert len(rows) == 1 + 3 + 1 + 1  # each table's header, 3 tests, the one file
    assert "| 1 | `tests/demo/test_demo.py` | 6 |" in text
    assert durations.render(durations.parse(junit)) == durations.render(run)  # deterministic


def test_command_line(junit: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert durations.main([str(junit), "--top", "1", "--files", "0"]) == 0
    out = capsys.readouterr().out
    assert "Slowest 1 tests:" in out and "files:" not in out
    bad = tmp_path / "bad.xml"
    bad.write_text("<html/>")
    assert durations.main([str(bad)]) == 2
    assert "no <testsuite>" in capsys.readouterr().err
    with pytest.raises(ValueError, match="top and files"):
        durations.render(durations.parse(junit), top=-1)


def test_the_passes_of_one_run_add_up(junit: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """make test's two passes (two junit files) render as one run: cases and walls add."""
    one = durations.parse(junit)
    both = durations.merge([one, one])
    assert len(both.cases) == 2 * len(one.cases) and both.wall_s == 2 * one.wall_s
    assert durations.main([str(junit), str(junit), "--top", "1", "--files", "0"]) == 0
    assert capsys.readouterr().out.startswith("12 tests: 8 passed, 2 failed, 2 skipped; ")
    with pytest.raises(ValueError, match="no junit file"):
        durations.merge([])
