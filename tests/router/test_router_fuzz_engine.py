"""Schema-driven fuzzing and hostile requests through the router to a real vLLM CPU engine
(the session's plain engine; the stub-engine runs are tests/router/test_router_fuzz.py):
the tenant and admin schemathesis runs, and the attacks of issue 32 against the engine
itself: every field at the extreme the router accepts is served by vLLM, each one past it
is refused by the router and (where the bound is vLLM's) by vLLM too."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvcentric.testing.servers import VllmServer, free_port
from tests.helpers.router_fuzz import (
    ADMIN,
    ENGINE,
    KEYED,
    METRICS,
    SPIN,
    TENANT,
    TIGHT,
    router,
    schemathesis,
    tail,
)


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
    assert rc == 0, tail(text)
    assert cases >= 1000, tail(text)
    assert httpx.get(real.router + "/health").status_code == 200  # alive and serving


@pytest.mark.vllm
def test_admin_operations_pass_every_check(real: Real, tmp_path: Path) -> None:
    rc, _, text = schemathesis(real.router, tmp_path, "--max-examples", "30",
                               "--include-path-regex", "^/instances", key=ADMIN)
    assert rc == 0, tail(text)
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
EDGES: list[tuple[str, dict[str, Any]]] = [
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
        base: dict[str, Any] = CHAT if "chat" in path else COMPLETION
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
