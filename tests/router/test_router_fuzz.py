"""Schema-driven fuzzing of the router (schemathesis, ``--checks all``), and hostile
requests through it to a real engine: the published OpenAPI document is exactly what the
router enforces (schema-valid requests are served, invalid ones get a documented 4xx), no
500s, documented statuses and content types only, and the router is alive afterwards.

With the stub engine (``benchmarks.lib.stub_engine``, no vLLM):

* an open router (loopback, no keys, default limits), the setting issue 32's run used:
  ``schemathesis run URL/openapi.json --checks all`` with schemathesis' own defaults is
  clean (ST201 and ST202 included), the admin operations too (instances it adds at
  random addresses never take traffic);
* a keyed router with tight limits, once per key (tenant, admin, metrics): bodies over the
  64 KiB limit are refused with 413, so 413 is expected for invalid data and, with 400,
  allowed for valid data only as the two limits a schema cannot state
  (``tests/helpers/schemathesis_checks.py`` fails any other such refusal).

With a real vLLM CPU engine (marked ``vllm``; run it under ``flock /tmp/kvc-vllm.lock``):
the tenant and admin runs, and the attacks of issue 32 against the engine itself: every
field at the extreme the router accepts is served by vLLM, each one past it is refused by
the router and (where the bound is vLLM's) by vLLM too.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from benchmarks.lib.paths import module_command
from kvcentric.testing.servers import (
    VllmServer,
    free_port,
    spawn,
    stop_group,
    wait_http,
)

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
    cmd += ["run", url + "/openapi.json", "--checks", "all", "--seed", "14", "--workers", "2",
            "--request-timeout", "60", "--max-response-time", "30", *args]
    if key:
        cmd += ["-H", f"Authorization: Bearer {key}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=tmp, env=env)
    text = out.stdout + out.stderr
    found = re.search(r"(\d+) generated", text)
    return out.returncode, int(found.group(1)) if found else 0, text


def _tail(text: str) -> str:
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


def test_open_router_is_clean_under_schemathesis_defaults(tiny_dir: str,
                                                          tmp_path: Path) -> None:
    with stub_engine(tmp_path, tiny_dir) as engine, router(tmp_path, engine) as url:
        rc, cases, text = schemathesis(url, tmp_path, "--max-examples", "40",
                                       limits_checked=False)
        assert rc == 0, _tail(text)
        assert cases >= 800, _tail(text)
        assert httpx.get(url + "/health").status_code == 200  # its engine still serves
        names = [i["name"] for i in httpx.get(url + "/instances").json()["instances"]]
        assert ENGINE in names


@pytest.mark.parametrize("key", [TENANT, ADMIN, METRICS])
def test_keyed_router_passes_every_check(tiny_dir: str, tmp_path: Path, key: str) -> None:
    with stub_engine(tmp_path, tiny_dir) as engine, \
            router(tmp_path, engine, auth=KEYED, limits=TIGHT) as url:
        rc, cases, text = schemathesis(url, tmp_path, "--max-examples", "40", key=key)
        assert rc == 0, _tail(text)
        assert cases >= 500, _tail(text)
        assert httpx.get(url + "/health").status_code == 200


# ---------------------------------------------------------------- a real vLLM engine

@dataclass
class Real:
    router: str
    engine: str


@pytest.fixture(scope="module")
def real(plain_tiny: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Real]:
    """This module's router in front of the session's plain engine (tests/helpers/engines.py:
    an upstream, shared; every request here is one an engine must survive, and the tests
    check that it did)."""
    tmp = tmp_path_factory.mktemp("fuzz")
    with router(tmp, plain_tiny.url, auth=KEYED, limits=TIGHT) as url:
        yield Real(url, plain_tiny.url)


@pytest.mark.vllm
def test_openai_operations_pass_every_check(real: Real, tmp_path: Path) -> None:
    rc, cases, text = schemathesis(real.router, tmp_path, "--max-examples", "60", key=TENANT)
    assert rc == 0, _tail(text)
    assert cases >= 1000, _tail(text)
    assert httpx.get(real.router + "/health").status_code == 200  # alive and serving


@pytest.mark.vllm
def test_admin_operations_pass_every_check(real: Real, tmp_path: Path) -> None:
    rc, _, text = schemathesis(real.router, tmp_path, "--max-examples", "30",
                               "--include-path-regex", "^/instances", key=ADMIN)
    assert rc == 0, _tail(text)
    # the fuzzer adds instances at random addresses: they never take traffic
    r = httpx.get(real.router + "/instances", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and ENGINE in [i["name"] for i in r.json()["instances"]]
    tenant = {"Authorization": f"Bearer {TENANT}"}
    for i in range(6):
        r = httpx.post(real.router + "/v1/completions", headers=tenant, timeout=60, json={
            "model": "tiny", "prompt": [5 + i] * 40, "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-kvc-decode"] == ENGINE, r.text


COMPLETION = {"model": "tiny", "prompt": "the river and the stone", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4}
# Each field at the extreme the router accepts: vLLM must serve every one.
EDGES = [
    ("/v1/completions", {"prompt_logprobs": 20, "logprobs": 20, "n": 4, "priority": 0}),
    ("/v1/completions", {"echo": True, "logprobs": 20, "max_tokens": 8, "min_tokens": 8}),
    ("/v1/completions", {"temperature": 2, "top_p": 1e-9, "top_k": 2**31 - 1, "min_p": 1,
                         "seed": -(2**63)}),
    ("/v1/completions", {"temperature": 0, "top_k": -1, "seed": 2**63 - 1, "min_p": 0,
                         "repetition_penalty": 2, "presence_penalty": -2,
                         "frequency_penalty": 2}),
    ("/v1/completions", {"stop_token_ids": [4095] * 64, "stop": ["x" * 64] * 4,
                         "ignore_eos": True, "include_stop_str_in_output": True,
                         "skip_special_tokens": False, "spaces_between_special_tokens": False,
                         "add_special_tokens": False, "return_token_ids": True}),
    ("/v1/completions", {"prompt": [4095] * 512, "stream": True, "prompt_logprobs": 0,
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 20, "prompt_logprobs": 20,
                              "add_generation_prompt": False, "add_special_tokens": True,
                              "max_completion_tokens": 8, "n": 4}),
]
# Each past the router's bound; True where the bound is vLLM's own (vLLM refuses it too;
# priority, n, max_tokens and the refused fields are the router's policy).
PAST = [
    ("prompt_logprobs", 21, True), ("prompt_logprobs", -1, True), ("logprobs", 21, True),
    ("priority", 1, False), ("priority", -1, False), ("temperature", 2.01, True),
    ("top_p", 0, True), ("min_p", 1.01, True), ("presence_penalty", 2.5, True),
    ("repetition_penalty", 0, True), ("stop_token_ids", [4096], True),
    ("max_tokens", 9, False), ("n", 5, False), ("chat_template", SPIN, False),
    ("kv_transfer_params", {"do_remote_decode": True}, False),
]


@pytest.mark.vllm
def test_hostile_requests_against_a_real_engine(real: Real) -> None:
    tenant = {"Authorization": f"Bearer {TENANT}"}
    admin = {"Authorization": f"Bearer {ADMIN}"}

    def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(url + path, json=body, headers=tenant, timeout=120)

    for path, extra in EDGES:
        base = CHAT if "chat" in path else COMPLETION
        r = post(real.router, path, {**base, **extra})
        assert r.status_code == 200, (extra, r.text[:500])
    for field, value, vllm_bound in PAST:
        r = post(real.router, "/v1/completions", {**COMPLETION, field: value})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, r.text)
        if vllm_bound:
            direct = httpx.post(real.engine + "/v1/completions", timeout=60,
                                json={**COMPLETION, field: value})
            assert direct.status_code == 400, (field, value, direct.text[:300])
    # the template cannot be replaced, nor rendered by the router
    r = post(real.router, "/v1/chat/completions",
             {**CHAT, "chat_template_kwargs": {"chat_template": SPIN}})
    assert r.status_code == 400 and "chat_template" in r.json()["error"]["message"]
    # a chat longer than the prompt bound is refused before it reaches the engine
    long = {**CHAT, "messages": [{"role": "user", "content": "river stone " * 250}]}
    r = post(real.router, "/v1/chat/completions", long)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # an instance nothing answers at, added at run time, takes no traffic
    r = httpx.post(real.router + "/instances", headers=admin, timeout=30,
                   json={"url": f"http://127.0.0.1:{free_port()}", "name": "dead"})
    assert r.status_code == 201 and r.json()["healthy"] is False
    for i in range(6):
        r = post(real.router, "/v1/completions", {**COMPLETION, "prompt": [7 + i] * 30})
        assert r.status_code == 200 and r.headers["x-kvc-decode"] == ENGINE, r.text
    assert httpx.delete(real.router + "/instances/dead", headers=admin).status_code == 200
    # observability without leaks
    assert httpx.get(real.router + "/metrics").status_code == 401
    assert httpx.get(real.router + "/metrics", headers=tenant).status_code == 403
    r = httpx.get(real.router + "/metrics", headers={"Authorization": f"Bearer {METRICS}"})
    assert r.status_code == 200 and "kvc_router_requests_total" in r.text
    assert httpx.get(real.engine + "/health").status_code == 200  # the engine survived
