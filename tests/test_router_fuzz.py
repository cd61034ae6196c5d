"""Schema-driven fuzzing of the router (schemathesis, ``--checks all``) with a real vLLM
CPU instance behind it: the published OpenAPI document is exactly what the router
enforces (schema-valid requests are served, invalid ones get a documented 4xx), no 500s,
documented statuses and content types only, and the router is alive afterwards.

Two runs: the OpenAI operations with a tenant key (the admin operations then answer the
documented 403), and the admin operations with the admin key.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from kvcentric.testing.servers import VllmServer, free_port, wait_http

pytestmark = pytest.mark.vllm
TENANT, ADMIN = "sk-fuzz-tenant", "sk-fuzz-admin"


@pytest.fixture(scope="module")
def router_url(tiny_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("fuzz")
    srv = VllmServer(tiny_dir, log_path=tmp / "vllm.log")
    proc = None
    try:
        srv.start().wait_ready()
        port = free_port()
        cfg = {"model": "tiny", "tokenizer": tiny_dir, "listen": {"port": port},
               "instances": [{"url": srv.url, "role": "both", "name": "a"}],
               "auth": {"api_keys": {TENANT: "fuzz"}, "admin_key": ADMIN},
               "limits": {"max_tokens": 8, "max_prompt_tokens": 512, "max_body_bytes": "64kb",
                          "max_concurrency_per_key": 32},
               "slo": {"ttft_ms": 60000, "tbt_ms": 10000}, "upstream": {"timeout_s": 60}}
        (tmp / "router.yaml").write_text(yaml.safe_dump(cfg))
        log = tmp / "router.log"
        proc = subprocess.Popen([sys.executable, "-m", "kvcentric.router.cli", "serve",
                                 "--config", str(tmp / "router.yaml")], stdout=open(log, "ab"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", proc, log, 60)
        yield url
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        srv.stop()


# Two limits JSON Schema cannot express, each answered with its documented status: a body
# over limits.max_body_bytes is refused with 413 before it is parsed (a rejection of the
# schema-violating bodies too big to fit, e.g. one message over the bound, each filled to
# kilobytes), and a schema-valid text that tokenizes to more than limits.max_prompt_tokens
# gets 400 (how many tokens a text makes depends on the tokenizer, so the schema bounds
# text by the body size, never by a guess of its tokens). Every other expectation is
# schemathesis's default.
CHECKS_TOML = """
[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422",
                     "428", "429", "5xx"]
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "3xx", "400", "401", "403", "404", "409", "429", "5xx"]
"""


def schemathesis(url: str, key: str, tmp: Path, *args: str) -> tuple[int, int, str]:
    """Run the schemathesis CLI; returns (exit code, test cases generated, output)."""
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert exe, "schemathesis is a dev dependency (pip install -e '.[dev]')"
    (tmp / "schemathesis.toml").write_text(CHECKS_TOML)
    out = subprocess.run([exe, "--config-file", str(tmp / "schemathesis.toml"), "run",
                          url + "/openapi.json", "--checks", "all",
                          "-H", f"Authorization: Bearer {key}", "--seed", "14",
                          "--workers", "2", "--request-timeout", "60",
                          "--max-response-time", "30", *args],
                         capture_output=True, text=True, timeout=1200, cwd=tmp)
    text = out.stdout + out.stderr
    found = re.search(r"(\d+) generated", text)
    return out.returncode, int(found.group(1)) if found else 0, text


def test_openai_operations_pass_every_check(router_url: str, tmp_path: Path) -> None:
    rc, cases, text = schemathesis(router_url, TENANT, tmp_path, "--max-examples", "60")
    assert rc == 0, text[-6000:]
    assert cases >= 1000, text[-2000:]
    assert httpx.get(router_url + "/health").status_code == 200  # alive and serving


def test_admin_operations_pass_every_check(router_url: str, tmp_path: Path) -> None:
    rc, _, text = schemathesis(router_url, ADMIN, tmp_path, "--max-examples", "30",
                               "--include-path-regex", "^/instances")
    assert rc == 0, text[-6000:]
    # the fuzzer adds and removes instances at will; the router still answers for them
    r = httpx.get(router_url + "/instances", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and isinstance(r.json()["instances"], list)
