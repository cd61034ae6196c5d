"""The skip policy of ``make test`` (tests/helpers/skip_policy.py): under ``KVC_NO_SKIPS=1``
a skip for a missing prerequisite (in a test, a fixture or at import) fails the run; a
``gpu`` test's skip and a skip that states a fact about the machine stay skips; without
the variable every skip stays a skip. The Makefile's ``test`` target sets it and installs
the peer routers first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import skip_policy

ROOT = Path(__file__).resolve().parents[1]

CASES = '''
import pytest

@pytest.fixture
def netns():
    pytest.skip("no netns: unshare failed")

def test_missing_tool():
    pytest.skip("chromium is not installed (make setup installs it)")

def test_missing_in_a_fixture(netns):
    pass

@pytest.mark.gpu
def test_needs_cuda():
    pytest.skip("needs CUDA")

def test_moot_here():
    pytest.skip("this machine has an active RDMA NIC")

@pytest.mark.xfail(reason="known", strict=True)
def test_known_bug():
    assert False

def test_runs():
    pass
'''


def _run(tmp_path: Path, strict: bool) -> dict[str, int]:
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_import.py").write_text(
        'import pytest\npytest.importorskip("kvc_no_such_module")\n\ndef test_x():\n    pass\n')
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    env = {k: v for k, v in os.environ.items() if k != skip_policy.ENV}
    env["PYTHONPATH"] = str(ROOT)
    if strict:
        env[skip_policy.ENV] = "1"
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.helpers.skip_policy",
                        "-p", "no:cacheprovider", "-q", "--continue-on-collection-errors",
                        "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path),
                        str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    last = r.stdout.strip().splitlines()[-1]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (\w+)", last)}
    assert (r.returncode != 0) == bool(counts.get("failed") or counts.get("error")), r.stdout
    return counts


def test_under_make_test_only_gpu_and_machine_facts_skip(tmp_path: Path) -> None:
    got = _run(tmp_path, strict=True)
    # the missing tool fails, the fixture's skip is an error at set-up, the module that
    # cannot import is a collection error; gpu and the machine fact stay skips
    assert got == {"failed": 1, "passed": 1, "skipped": 2, "xfailed": 1, "errors": 2}, got


def test_a_developer_run_keeps_its_skips(tmp_path: Path) -> None:
    got = _run(tmp_path, strict=False)
    assert got == {"passed": 1, "skipped": 5, "xfailed": 1}, got


def test_the_rules() -> None:
    assert skip_policy.allowed("needs CUDA", ["gpu", "vllm"])
    assert skip_policy.allowed("This machine has CUDA (see tests/gpu)", [])
    assert skip_policy.allowed("this test process is pinned", [])
    assert not skip_policy.allowed("no netns: unshare failed", ["mooncake"])
    assert not skip_policy.allowed("chromium is not installed (make setup installs it)", [])


def test_make_test_enforces_it() -> None:
    make = (ROOT / "Makefile").read_text()
    recipe = make.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    # the policy's variable on the pytest command itself (.ci/cleanup-run passes the
    # environment on); peers: test_bench_gateways
    assert re.search(rf"{skip_policy.ENV}=1 (\.ci/cleanup-run )?\$\(BIN\)/python -m pytest",
                     recipe), recipe
