"""Packaging: one ``kvcentric`` namespace, and extras that never touch a user's GPU stack.

- The wheel holds ``kvcentric/kernels`` and ``kvcentric/router`` and nothing named
  ``kernels`` or ``router`` at the top level (both names are taken on PyPI).
- ``pip install --dry-run --report`` in a fresh venv: ``kvcentric`` and
  ``kvcentric[vllm,router]`` pull neither ``torch`` nor any ``vllm*`` distribution
  (users bring their own vLLM build); ``[mooncake]`` is the CUDA-capable wheel.
- No module imports the top-level ``kernels``/``router`` packages, and outside the
  repository they are not importable from the installed package.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import kvcentric.compat
from kvcentric.compat import check_engine, missing_attrs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty venv (no pip of its own: the development venv's pip resolves for it)."""
    d = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(d)
    return d / "bin" / "python"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, built once as a user builds it (build isolation)."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                    "--wheel-dir", str(out), str(ROOT)], check=True, timeout=600,
                   capture_output=True)
    (whl,) = out.glob("kvcentric-*.whl")
    return whl


def _resolve(python: Path, spec: str, tmp: Path) -> dict[str, str]:
    """What pip would install for ``spec`` into an empty venv: {name: version}."""
    report = tmp / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                    "--dry-run", "--quiet", "--ignore-installed", "--report", str(report), spec],
                   cwd=ROOT, check=True, timeout=600, capture_output=True)
    items = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in items}


@pytest.mark.parametrize("extras", ["", "[vllm,router]"])
def test_extras_pull_no_torch_and_no_vllm(fresh_venv: Path, wheel: Path, tmp_path: Path,
                                          extras: str) -> None:
    got = _resolve(fresh_venv, f"{wheel}{extras}", tmp_path)  # the wheel's metadata
    assert "kvcentric" in got
    assert "torch" not in got, got
    assert not [n for n in got if n.startswith("vllm")], got
    if extras:
        assert "fastapi" in got and "transformers" in got  # the router's own deps do come


def test_mooncake_extra_is_the_cuda_capable_wheel() -> None:
    from importlib.metadata import requires

    reqs = requires("kvcentric") or []
    mooncake = [r for r in reqs if "extra == \"mooncake\"" in r]
    cpu = [r for r in reqs if "extra == \"mooncake-cpu\"" in r]
    assert mooncake and all(r.startswith("mooncake-transfer-engine>=") for r in mooncake)
    assert cpu and all(r.startswith("mooncake-transfer-engine-non-cuda") for r in cpu)
    assert not [r for r in reqs if r.startswith(("vllm", "torch"))], reqs


def test_wheel_installs_one_namespace(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"kvcentric"}, tops
    for mod in ("kvcentric/kernels/dispatch.py", "kvcentric/router/api/app.py",
                "kvcentric/connector/vllm/connector.py", "kvcentric/store/mooncake/store.py"):
        assert mod in names
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt")))
    assert b"kvcentric.connector.vllm.plugin:register" in entry
    assert b"kvcentric-router = kvcentric.router.cli:main" in entry


def test_installed_namespace_outside_the_repository(tmp_path: Path) -> None:
    code = ("import importlib.util, kvcentric.kernels, kvcentric.router, kvcentric.connector.vllm;"
            "print(importlib.util.find_spec('kernels'), importlib.util.find_spec('router'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True, env={"PATH": "/usr/bin:/bin"}).stdout
    assert out.split() == ["None", "None"]  # nothing named kernels/router from our install


def test_no_module_imports_the_top_level_packages() -> None:
    bad = []
    for folder in ("kvcentric", "kernels", "router", "tests", "benchmarks", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom)
                         and node.level == 0 else [])
                bad += [f"{path}: {n}" for n in names if n.split(".")[0] in ("kernels", "router")]
    assert not bad


def test_user_facing_names_keep_working() -> None:
    import kvcentric.connector.sglang as sg
    import kvcentric.connector.vllm as vl

    assert vl.__all__ == ["KVCentricConnector"] and sg.__all__ == ["KVCentricHiCacheStorage"]
    with pytest.raises(AttributeError):
        vl.NoSuchThing  # noqa: B018
    code = ("import kvcentric.connector.vllm.settings, sys; assert 'vllm' not in sys.modules; "
            "from kvcentric.connector.vllm import KVCentricConnector; "
            "from kvcentric.connector.sglang import KVCentricHiCacheStorage; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_engine_version_check(caplog: pytest.LogCaptureFixture) -> None:
    class Base:
        def hook(self) -> None: ...

    tested, checked = kvcentric.compat.TESTED_VLLM, kvcentric.compat.API_CHECKED_VLLM
    assert missing_attrs(Base, ("hook", "gone"), "Base") == ["Base.gone"]
    with pytest.raises(RuntimeError, match=r"vLLM 0\.31\.0 lacks Base\.gone, which kvcentric "
                                           r"needs; use a tested version \(0\.32\.0, "):
        check_engine("vLLM", "0.31.0", tested, ["Base.gone"])
    with pytest.raises(RuntimeError, match=r"vLLM 0\.29\.2 is older than 0\.30\.0, the oldest"):
        check_engine("vLLM", "0.29.2", tested, [], kvcentric.compat.MIN_VLLM)
    for version in ("0.30.0", "0.31.0", "0.32.0+cpu"):
        check_engine("vLLM", version, tested, [], kvcentric.compat.MIN_VLLM, checked)
    assert not caplog.records
    with caplog.at_level("INFO", "kvcentric.compat"):
        check_engine("vLLM", "0.33.0", tested, [], kvcentric.compat.MIN_VLLM, checked)
    assert "API checked" in caplog.text and "untested" not in caplog.text
    check_engine("vLLM", "0.99.0", tested, [], kvcentric.compat.MIN_VLLM, checked)
    assert "vLLM 0.99.0 is untested" in caplog.text
    assert kvcentric.compat.release("0.32.0rc1.dev5+cpu") == (0, 32, 0)


# versions on each side of every boundary of the policy (kvcentric.compat's docstring)
POLICY_CASES = {"0.29.9": "too old", "0.30.0": "tested", "0.30.1": "checked",
                "0.31.1": "checked", "0.32.0+cpu": "tested", "0.32.3": "checked",
                "0.33.0": "checked", "0.33.1": "checked", "0.33.9": "checked",
                "0.34.0": "untested", "1.0.0": "untested"}


def test_readme_gate_and_doctor_agree_on_the_supported_versions(
        caplog: pytest.LogCaptureFixture) -> None:
    """One rule: patch releases of a tested or API-checked minor are checked. The README's
    "Supported" range, the connector's start-up gate and the doctor (for an installed
    engine or one at a URL) say the same of every version."""
    from kvcentric.compat import MIN_VLLM, VLLM_SUPPORTED, vllm_support
    from kvcentric.doctor.engines import VLLM, version_finding

    readme = (ROOT / "README.md").read_text()
    (said,) = re.findall(r"Supported: \*\*vLLM ([^*]+)\*\*", readme)
    assert said == VLLM_SUPPORTED == "0.30.0 – 0.33.x"
    low, high = said.split(" – ")
    tested, checked = kvcentric.compat.TESTED_VLLM, kvcentric.compat.API_CHECKED_VLLM
    for version, level in POLICY_CASES.items():
        assert vllm_support(version) == level, version
        release = kvcentric.compat.release(version)
        in_range = (kvcentric.compat.release(low) <= release
                    and release[:2] <= kvcentric.compat.release(high.removesuffix(".x")))
        assert in_range == (level in ("tested", "checked")), version  # the README's range
        caplog.clear()
        with caplog.at_level("INFO", "kvcentric.compat"):
            if level == "too old":
                with pytest.raises(RuntimeError, match=f"older than {MIN_VLLM}"):
                    check_engine("vLLM", version, tested, [], MIN_VLLM, checked)
                continue
            check_engine("vLLM", version, tested, [], MIN_VLLM, checked)
        gate = {r.levelname for r in caplog.records}
        finding = version_finding("vllm-version", VLLM, version, "", {})
        if level == "untested":
            assert gate == {"WARNING"} and finding.status == "warn", version
            assert VLLM_SUPPORTED in (finding.fix or ""), finding  # advice: the range
        else:  # tested: silent; checked: an info line; the doctor is satisfied with both
            assert gate == (set() if level == "tested" else {"INFO"}), version
            assert finding.status == "ok" and not finding.fix, (version, finding)
