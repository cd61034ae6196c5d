"""The router under schemathesis (tests/router/test_router_fuzz.py with the stub engine,
tests/router/test_router_fuzz_engine.py with a real vLLM engine): the router as a process
in front of an engine, the stub engine, and the schemathesis CLI with every check."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from benchmarks.lib.paths import module_command
from kvcentric.testing.servers import free_port, spawn, stop_group, wait_http

ROOT = Path(__file__).resolve().parents[2]
TENANT, ADMIN, METRICS = "sk-fuzz-tenant", "sk-fuzz-admin", "sk-fuzz-metrics"
ENGINE = "engine-7f3a"  # a name the fuzzer's DELETE /instances/{name} will not guess
KEYED = {"api_keys": {TENANT: "fuzz"}, "admin_key": ADMIN, "metrics_key": METRICS,
         "salt_secret": "fuzz-salt-secret-0123456789"}
TIGHT = {"max_tokens": 8, "max_prompt_tokens": 512, "max_body_bytes": "64kb",
         "max_concurrency_per_key": 32}
# Invalid data over the body limit is refused before it is parsed (413: a refusal, not in
# schemathesis' default list); valid data may get 400 or 413 only for the two documented
# limits, which the hook checks case by case.
CHECKS_TOML = """
[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422",
                     "428", "429", "5xx"]
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "3xx", "400", "401", "403", "404", "409", "413", "429", "5xx"]
"""
SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"


def schemathesis(url: str, tmp: Path, *args: str, key: str | None = None,
                 limits_checked: bool = True) -> tuple[int, int, str]:
    """Run the schemathesis CLI with every check; returns (exit code, test cases, output).
    ``limits_checked``: allow the two documented limits for valid data (with the hook
    that checks them); False runs with schemathesis' own defaults."""
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert exe, "schemathesis is a dev dependency (pip install -e '.[dev]')"
    cmd = [exe]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVC_FUZZ_MAX_BODY_BYTES": str(64 << 10)}
    if limits_checked:
        (tmp / "schemathesis.toml").write_text(CHECKS_TOML)
        cmd += ["--config-file", str(tmp / "schemathesis.toml")]
        env["SCHEMATHESIS_HOOKS"] = "tests.helpers.schemathesis_checks"
    # hypothesis builds the code points a codec can encode (seconds of CPU in each worker
    # thread that first needs them) and caches them below its storage directory, by
    # default the run's fresh cwd: one directory for every run builds them once; the
    # examples database stays the run's own, where it was
    env["HYPOTHESIS_STORAGE_DIRECTORY"] = str(ROOT / "build" / "hypothesis")
    cmd += ["run", url + "/openapi.json", "--checks", "all", "--seed", "14", "--workers", "2",
            "--generation-database", str(tmp / ".hypothesis" / "examples"),
            "--request-timeout", "60", "--max-response-time", "30", *args]
    if key:
        cmd += ["-H", f"Authorization: Bearer {key}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=tmp, env=env)
    text = out.stdout + out.stderr
    found = re.search(r"(\d+) generated", text)
    return out.returncode, int(found.group(1)) if found else 0, text


def tail(text: str) -> str:
    """The failures of a run, without the request bodies that run to megabytes."""
    keep = [line[:300] for line in text.splitlines() if "curl -X" not in line]
    return "\n".join(keep)[-8000:]


@contextlib.contextmanager
def router(tmp: Path, engine_url: str, **over: Any) -> Iterator[str]:
    """The router as its own process in front of ``engine_url``; yields its URL."""
    port = free_port()
    cfg = {"model": "tiny", "tokenizer": str(ROOT / ".models" / "tiny"),
           "listen": {"port": port}, "health": {"interval_s": 0.5},
           "instances": [{"url": engine_url, "role": "both", "name": ENGINE}],
           "slo": {"ttft_ms": 60000, "tbt_ms": 10000}, "upstream": {"timeout_s": 60}, **over}
    (tmp / "router.yaml").write_text(yaml.safe_dump(cfg))
    log = tmp / "router.log"
    proc = spawn([sys.executable, "-m", "kvcentric.router.cli", "serve", "--config",
                  str(tmp / "router.yaml")], log)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, log, 120)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_group(proc)


@contextlib.contextmanager
def stub_engine(tmp: Path, tiny_dir: str) -> Iterator[str]:
    port = free_port()
    log = tmp / "stub.log"
    proc = spawn(module_command("benchmarks.lib.stub_engine", "--ports", str(port),
                                "--model", "tiny", "--tokenizer", tiny_dir), log)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, log, 120)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_group(proc)
