"""Clean installs, as a user makes them without make: every console script runs, a missing
extra says which to install, and the README's quickstart works as written.

- **Plain wheel.** The wheel, built from a fresh clone of this working tree, installs into a
  clean venv with no extra: every console script and every subcommand answers ``--help``
  (and the ``python -m`` forms), ``kvcentric doctor`` runs, and each command that needs an
  extra says which one in one line (exit 2, no traceback).
- **[router], the quickstart.** The README's "Quickstart (without make)" block runs as
  written from a fresh ``git clone`` into its own venv (``pip install '.[router]'``: the
  ``[router]`` extra's clean venv, built from the checkout as a user builds it), with three
  placeholders filled in: the repository, the model folder (a tiny model built here; the
  router takes any local model folder) and the ports. A stub engine
  (``benchmarks/lib/stub_engine.py``) stands in for vLLM. The doctor must pass and the
  router must answer ``/health`` with ``ok``; then every console script answers ``--help``
  in that venv.
- **Extras cover the imports.** Every module :data:`kvcentric.extras.EXTRA_OF` names comes
  with the extra it names (``pyproject.toml``, directly or as a dependency of one).

- **Each engine extra.** The wheel with ``[mooncake-cpu]``, ``[kernels]`` and ``[sglang]``,
  each in a clean venv of its own: every console script and subcommand answers ``--help``
  and the doctor runs (what the extra brings must not break what the package carries).

Extras installed here: none, ``[router]``, ``[mooncake-cpu]``, ``[kernels]`` and ``[sglang]``;
``[vllm]`` installs nothing. Not installed: ``[mooncake]``, Mooncake's CUDA wheel (the
``[mooncake-cpu]`` venv covers the same commands on a machine without CUDA).

Kept short: pip's cache, one venv per extra, module-scoped fixtures, no byte-compiling of
what pip installs (:data:`NO_COMPILE`; ``PIP_COMPILE=0`` for the quickstart, whose
commands run as written); the plain venv is made without pip (the development venv's pip
installs into it) and its wheel is built without build isolation (the development venv's
setuptools).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

import pytest

from kvcentric.extras import EXTRA_OF
from kvcentric.testing.servers import free_port, spawn, stop_group, wait_http

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS = sorted(PYPROJECT["project"]["scripts"])
MODULE_FORMS = ("kvcentric.cli", "kvcentric.router.cli", "kvcentric.store.mooncake.service",
                "kvcentric.bench_serving")
README_BLOCK = "kvcentric-router init"  # the quickstart's bash block holds this command
# pip byte-compiles what it installs by default (transformers alone is thousands of
# modules): a third of each install's time, and nothing these tests check (a user's
# first import compiles what it needs). Off in every venv made here.
NO_COMPILE = "--no-compile"


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from kvcentric.cli import build_parser as kvc
    from kvcentric.router.cli import build_parser as router

    return {"kvcentric": kvc(), "kvcentric-router": router()}


def _subcommands(ap: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
                 ) -> Iterator[tuple[str, ...]]:
    """Every command path of ``ap``: ``()``, ``("store",)``, ``("store", "serve")``, ..."""
    yield prefix
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, (*prefix, name))


def _help_commands() -> list[list[str]]:
    parsers = _parsers()
    assert sorted(parsers) == SCRIPTS  # a new console script needs its parser here
    cmds = [[script, *path, "--help"] for script, ap in parsers.items()
            for path in _subcommands(ap)]
    return cmds + [["python", "-m", mod, "--help"] for mod in MODULE_FORMS]


def _clean_env(bin_dir: Path | None = None) -> dict[str, str]:
    """The environment of a user's shell (with ``bin_dir`` first): no development venv, no
    PYTHONPATH (pip's own settings, e.g. its cache and index, stay)."""
    dev_bins = {str(Path(sys.prefix) / "bin"), str(ROOT / ".venv" / "bin")}
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p not in dev_bins]
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PATH"] = os.pathsep.join([str(bin_dir), *path] if bin_dir else path)
    env["PIP_COMPILE"] = "0"  # see NO_COMPILE
    return env


def _run(cmd: list[str], bin_dir: Path, cwd: Path, timeout: float = 300
         ) -> subprocess.CompletedProcess[str]:
    exe = str(bin_dir / cmd[0]) if (bin_dir / cmd[0]).exists() else cmd[0]
    return subprocess.run([exe, *cmd[1:]], cwd=cwd, env=_clean_env(bin_dir),
                          capture_output=True, text=True, timeout=timeout)


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh ``git clone`` of this repository holding its working tree: uncommitted and
    new (not ignored) files are copied over and committed, so that a clone of it is what a
    user would clone once they are committed."""
    dest = tmp_path_factory.mktemp("checkout") / "kvcentric"
    _git("clone", "-q", str(ROOT), str(dest), cwd=ROOT)
    changed = _git("ls-files", "-z", "-m", "-o", "--exclude-standard", cwd=ROOT).split("\0")
    for rel in filter(None, set(changed)):
        src, dst = ROOT / rel, dest / rel
        if dst.is_symlink() or dst.exists():
            dst.unlink()
        if src.is_symlink() or src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst, follow_symlinks=False)
    if _git("status", "--porcelain", cwd=dest).strip():
        _git("add", "-A", cwd=dest)
        _git("-c", "user.name=test", "-c", "user.email=test@localhost", "commit", "-q",
             "-m", "working tree", cwd=dest)
    return dest


@pytest.fixture(scope="module")
def wheel(checkout: Path) -> Path:
    out = checkout.parent / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "--wheel-dir", str(out), str(checkout)], check=True,
                   capture_output=True, timeout=600)
    (whl,) = out.glob("kvcentric-*.whl")
    return whl


@pytest.fixture(scope="module")
def plain(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean venv with the wheel and no extra; its ``bin``."""
    venv = tmp_path_factory.mktemp("plain") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "--quiet", NO_COMPILE, str(wheel)], check=True,
                   capture_output=True, timeout=600)
    return venv / "bin"


def _assert_helps(bin_dir: Path, cwd: Path) -> None:
    bad = []
    for cmd in _help_commands():
        out = _run(cmd, bin_dir, cwd)
        if out.returncode != 0 or "usage:" not in out.stdout:
            bad.append(f"{' '.join(cmd)}: exit {out.returncode}: {out.stderr[-800:]}")
    assert not bad, "\n".join(bad)


def test_plain_install_runs_every_command(plain: Path, wheel: Path, tmp_path: Path) -> None:
    # the README's install-from-a-wheel line names the wheel this version builds
    assert f"pip install 'dist/{wheel.name}[router]'" in (ROOT / "README.md").read_text()
    _assert_helps(plain, tmp_path)
    out = _run(["kvcentric", "doctor", "--json"], plain, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    checks = {f["check"]: f["status"] for f in json.loads(out.stdout)["findings"]}
    assert checks["vllm-version"] == "skip" and checks["engines"] == "warn"
    out = _run(["kvcentric-router", "init", "router.yaml"], plain, tmp_path)
    assert out.returncode == 0 and (tmp_path / "router.yaml").is_file(), out.stderr


def _one_line(out: subprocess.CompletedProcess[str], *needles: str) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr and all(n in lines[0] for n in needles), lines
    return lines[0]


@pytest.mark.parametrize("extra", ["mooncake-cpu", "kernels", "sglang"])
def test_each_engine_extra_installs_and_every_command_runs(
        extra: str, wheel: Path, tmp_path_factory: pytest.TempPathFactory,
        tmp_path: Path) -> None:
    venv = tmp_path_factory.mktemp(extra) / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "--quiet", NO_COMPILE, f"{wheel}[{extra}]"], check=True,
                   capture_output=True, timeout=900)
    _assert_helps(venv / "bin", tmp_path)
    out = _run(["kvcentric", "doctor", "--json"], venv / "bin", tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["findings"]


def test_a_missing_extra_is_one_line_naming_it(plain: Path, tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "router.yaml").write_text(
        "model: m\ntokenizer: model\ninstances: [{url: 'http://127.0.0.1:9'}]\n")
    router = "pip install 'kvcentric[router]'"
    mooncake = "pip install 'kvcentric[mooncake]'"
    cases = [
        (["kvcentric-router", "serve", "--config", "router.yaml"], router),
        (["python", "-m", "kvcentric.router.cli", "serve", "--config", "router.yaml"], router),
        (["kvcentric-router", "profile", "--url", "http://127.0.0.1:9", "--model", "m",
          "--out", "p.json"], router),
        (["kvcentric", "doctor", "--url", "http://127.0.0.1:9"], router),
        (["kvcentric", "doctor", "--router-config", "router.yaml"], router),
        (["kvcentric", "store", "mooncake-master"], mooncake),
        (["kvcentric", "store", "mooncake-node", "--segment", "1gb", "--master",
          "127.0.0.1:9"], mooncake),
        (["python", "-m", "kvcentric.store.mooncake.service", "mooncake-master"], mooncake),
        (["kvcentric", "bench", "--base-url", "http://127.0.0.1:9", "--model", "m",
          "--tokenizer", "model"], router),
        (["python", "-m", "kvcentric.bench_serving", "--base-url", "http://127.0.0.1:9",
          "--model", "m", "--tokenizer", "model"], router),
    ]
    for cmd, needle in cases:
        _one_line(_run(cmd, plain, tmp_path), needle)


def test_doctor_store_file_missing_is_one_line(plain: Path, tmp_path: Path) -> None:
    line = _one_line(_run(["kvcentric", "doctor", "--store", "@missing.json"], plain,
                          tmp_path), "missing.json")
    assert "No such file" in line


def test_extras_cover_the_imports() -> None:
    """Each optional module comes with the extra :data:`EXTRA_OF` names (directly, or as
    a dependency of a distribution that extra names)."""
    extras = PYPROJECT["project"]["optional-dependencies"]

    def names(reqs: list[str]) -> set[str]:
        return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-")
                for r in reqs}

    dists = packages_distributions()
    bad = []
    for module, extra in EXTRA_OF.items():
        wanted = [e for e in extras if e == extra or e.startswith(f"{extra}-")]
        direct = set().union(*(names(extras[e]) for e in wanted))
        indirect = set()
        for d in direct:
            try:
                indirect |= names([r for r in requires(d) or [] if "extra ==" not in r])
            except PackageNotFoundError:
                continue
        have = {d.lower().replace("_", "-") for d in dists.get(module, [])}
        assert have, f"{module} is not installed in the development venv"
        if not have & (direct | indirect):
            bad.append(f"{module} ({sorted(have)}) is not installed by [{extra}]")
    assert not bad, bad


def test_run_cli_turns_only_missing_extras_into_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvcentric.extras import MissingExtra, run_cli

    def needs(name: str) -> int:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    assert run_cli("prog", lambda argv: needs("jinja2.sandbox")) == 2
    assert capsys.readouterr().err == ("prog: this command needs jinja2, which is not "
                                       "installed: pip install 'kvcentric[router]'\n")
    assert run_cli("prog", lambda argv: (_ for _ in ()).throw(MissingExtra("say this"))) == 2
    assert capsys.readouterr().err == "prog: say this\n"
    with pytest.raises(ModuleNotFoundError):  # not an optional dependency: a bug, raised
        run_cli("prog", lambda argv: needs("numpy"))
    assert run_cli("prog", lambda argv: 7, []) == 7


# ---- the README's quickstart ----
def quickstart_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quickstart (without make)"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    (block,) = [b for b in blocks if README_BLOCK in b]
    assert "curl -s http://127.0.0.1:8000/health" in section
    return block


@pytest.fixture
def stub_engine(tiny_dir: str, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = tmp_path / "stub.log"
    proc = spawn([sys.executable, "-m", "benchmarks.lib.stub_engine", "--ports", str(port),
                  "--model", "my-model", "--tokenizer", tiny_dir], log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", proc, log, timeout_s=120)
        yield url
    finally:
        stop_group(proc)


def test_readme_quickstart_from_a_fresh_clone(checkout: Path, tiny_dir: str,
                                              stub_engine: str, tmp_path: Path) -> None:
    assert shutil.which("curl"), "curl is not installed (make setup's base image has it)"
    port = free_port()
    fills = {"<repository URL>": str(checkout), "/path/to/model-folder": tiny_dir,
             "http://127.0.0.1:8100": stub_engine, "--port 8000": f"--port {port}"}
    block = quickstart_block()
    for placeholder, value in fills.items():
        assert placeholder in block, placeholder
        block = block.replace(placeholder, value)
    lines = [ln for ln in block.replace("\\\n", " ").splitlines() if ln.strip()]
    (serve,) = [i for i, ln in enumerate(lines) if "kvcentric-router serve" in ln]
    assert serve == len(lines) - 1, "the router starts last (it runs in the foreground)"
    script = "\n".join([
        "set -euo pipefail", *lines[:serve],
        f"{lines[serve]} > serve.log 2>&1 &", "SERVE=$!",
        "trap 'kill $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT",
        "for _ in $(seq 600); do",
        f"  body=$(curl -s http://127.0.0.1:{port}/health || true)",
        '  case "$body" in *\'"status":"ok"\'*) echo "HEALTH $body"; exit 0;; esac',
        "  kill -0 $SERVE 2>/dev/null || break",
        "  sleep 0.5",
        "done",
        "cat serve.log >&2; exit 1"])
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=_clean_env(),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "HEALTH" in out.stdout
    # the doctor passed (set -e) and checked the tokenizer folder and the engine
    assert "[FAIL]" not in out.stdout and "0 problem(s)" in out.stdout, out.stdout[-4000:]
    for check in ("router-tokenizer", "router-model-config", "router-instance"):
        assert f"[ok  ] {check}" in out.stdout, out.stdout[-4000:]
    bin_dir = tmp_path / "kvcentric" / ".venv" / "bin"
    _assert_helps(bin_dir, tmp_path)
    # uvicorn serves the router with its C parser and event loop only when they are
    # installed, and the router reaches its engines through aiohttp: [router] brings all
    fast = _run(["python", "-c", "import aiohttp, httptools, uvloop"], bin_dir, tmp_path)
    assert fast.returncode == 0, fast.stderr[-2000:]
