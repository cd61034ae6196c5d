"""Router keys, tenants and limits, in process (see tests/router/test_router_app.py for the fake
engines): 401 without a key, tenant salts on the forwarded body, admin endpoints closed to
tenant keys, the loopback refusal, and every limit with its status (413, 400, 429 +
Retry-After, released after streamed answers). Tenant isolation on real vLLM engines and
a real store is in tests/e2e/test_router_e2e.py."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from kvcentric.router.config import RouterConfig
from kvcentric.router.tokenize import PromptTokenizer
from tests.router.test_router_app import TWO, Upstreams, make_cfg, run

KEYS = {"sk-team-a-0001": "team-a", "sk-team-b-0002": "team-b"}
ADMIN = "sk-admin-9999"
A = {"Authorization": "Bearer sk-team-a-0001"}
B = {"Authorization": "Bearer sk-team-b-0002"}
BODY = {"model": "tiny", "prompt": "hello world", "max_tokens": 2}


def keyed(tiny_dir: str, **over: Any) -> RouterConfig:
    return make_cfg(tiny_dir, TWO, auth={"api_keys": KEYS, "admin_key": ADMIN}, **over)


def test_requests_need_a_valid_key(tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    ups = Upstreams()

    async def fn(c: httpx.AsyncClient) -> None:
        for headers in ({}, {"Authorization": "Bearer nope-nope-nope"},
                        {"Authorization": "Basic sk-team-a-0001"}):
            for path in ("/v1/completions", "/v1/chat/completions"):
                r = await c.post(path, json=BODY, headers=headers)
                assert r.status_code == 401, (headers, r.text)
                assert r.headers["www-authenticate"].startswith("Bearer")
                assert r.json()["error"]["type"] == "authentication_error"
            assert (await c.get("/v1/models", headers=headers)).status_code == 401
        assert ups.calls == []  # nothing reached an engine
        assert (await c.get("/v1/models", headers=A)).status_code == 200
        assert (await c.get("/health")).status_code == 200  # probes need no key

    run(keyed(tiny_dir), tokenizer, ups, fn)


def test_tenant_salts_namespace_the_kv(tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    ups = Upstreams()

    async def fn(c: httpx.AsyncClient) -> None:
        assert (await c.post("/v1/completions", json=BODY, headers=A)).status_code == 200
        assert (await c.post("/v1/completions", json=BODY, headers=B)).status_code == 200
        salted = dict(BODY, cache_salt="user-7")
        assert (await c.post("/v1/completions", json=salted, headers=A)).status_code == 200
        for bad in ("a/b", "x" * 107, "", "a@b"):  # vLLM's rules, less the tenant's part
            r = await c.post("/v1/completions", json=dict(BODY, cache_salt=bad), headers=A)
            assert r.status_code == 400, bad

    run(keyed(tiny_dir), tokenizer, ups, fn)
    a, b, a7 = (body.get("cache_salt") for _, _, body in ups.calls)
    assert a.startswith("kvct-") and len(a) == 21 and b != a and a7 == a + ".user-7"
    # vLLM refuses '@', '/', '\' and NUL in a salt, and over 128 characters
    assert all(not set(x) & set("@/\\\x00") and len(x) <= 128 for x in (a, b, a7))


def test_router_keys_are_not_forwarded_to_engines(tiny_dir: str,
                                                  tokenizer: PromptTokenizer) -> None:
    seen: list[str | None] = []
    ups = Upstreams()
    handler = ups.handler

    async def spy(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":  # the requests (health checks read /v1/models)
            seen.append(request.headers.get("authorization"))
        return await handler(request)

    ups.handler = spy  # type: ignore[method-assign]

    async def fn(c: httpx.AsyncClient) -> None:
        assert (await c.post("/v1/completions", json=BODY, headers=A)).status_code == 200

    run(keyed(tiny_dir), tokenizer, ups, fn)
    run(keyed(tiny_dir, upstream={"api_key": "sk-engine-key"}), tokenizer, ups, fn)
    assert seen == [None, "Bearer sk-engine-key"]


def test_admin_endpoints_need_the_admin_key(tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    new = {"url": "http://c:1", "name": "c"}

    async def fn(c: httpx.AsyncClient) -> None:
        assert (await c.get("/instances")).status_code == 401
        assert (await c.get("/instances", headers=A)).status_code == 403
        assert (await c.post("/instances", json=new, headers=A)).status_code == 403
        assert (await c.delete("/instances/a", headers=B)).status_code == 403
        admin = {"Authorization": f"Bearer {ADMIN}"}
        assert (await c.post("/instances", json=new, headers=admin)).status_code == 201
        assert (await c.delete("/instances/c", headers=admin)).status_code == 200
        names = [i["name"] for i in (await c.get("/instances", headers=admin)).json()["instances"]]
        assert names == ["a", "b"]

    run(keyed(tiny_dir), tokenizer, Upstreams(), fn)


def test_keys_without_admin_key_close_the_admin_endpoints(tiny_dir: str,
                                                          tokenizer: PromptTokenizer) -> None:
    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.get("/instances", headers=A)
        assert r.status_code == 403 and "no admin key" in r.json()["error"]["message"]

    run(make_cfg(tiny_dir, TWO, auth={"api_keys": KEYS}), tokenizer, Upstreams(), fn)


def test_keys_from_the_environment_and_bad_auth_config(tiny_dir: str) -> None:
    raw = {"model": "tiny", "tokenizer": tiny_dir}
    env = {"KVCENTRIC_ROUTER_API_KEYS": "sk-env-key-01=env-team, sk-env-key-02=other",
           "KVCENTRIC_ROUTER_ADMIN_KEY": "sk-env-admin",
           "KVCENTRIC_ROUTER_UPSTREAM_API_KEY": "sk-engines"}
    cfg = RouterConfig.from_dict(raw, env)
    assert cfg.upstream.api_key == "sk-engines"
    assert dict(cfg.auth.api_keys) == {"sk-env-key-01": "env-team", "sk-env-key-02": "other"}
    assert cfg.auth.admin_key == "sk-env-admin"
    for bad in ({"api_keys": {"short": "t"}}, {"api_keys": {"sk-long-enough": "a/b"}},
                {"api_keys": ["sk-long-enough"]}, {"admin_key": "sk-team-a-0001",
                                                   "api_keys": KEYS}, {"allow_open": "maybe"}):
        with pytest.raises(ValueError, match="auth"):
            RouterConfig.from_dict({**raw, "auth": bad})
    with pytest.raises(ValueError, match="key=tenant"):
        RouterConfig.from_dict(raw, {"KVCENTRIC_ROUTER_API_KEYS": "sk-no-tenant-here"})


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "router.example"])
def test_refuses_to_listen_open_on_a_non_loopback_address(tiny_dir: str, host: str) -> None:
    raw = {"model": "tiny", "tokenizer": tiny_dir, "listen": {"host": host}}
    with pytest.raises(ValueError, match="without API keys"):
        RouterConfig.from_dict(raw)
    RouterConfig.from_dict({**raw, "auth": {"api_keys": KEYS}})
    RouterConfig.from_dict({**raw, "auth": {"allow_open": True}})
    for ok in ("127.0.0.1", "::1", "localhost"):
        RouterConfig.from_dict({**raw, "listen": {"host": ok}})


def test_limits_answer_413_and_400(tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    ups = Upstreams()
    limits = {"max_body_bytes": 2048, "max_prompt_tokens": 50, "max_tokens": 16}

    async def fn(c: httpx.AsyncClient) -> None:
        big = dict(BODY, prompt="x " * 2000)
        r = await c.post("/v1/completions", json=big)
        assert r.status_code == 413 and "2048" in r.json()["error"]["message"]

        async def chunks() -> Any:  # no Content-Length: counted while received
            for _ in range(10):
                yield b" " * 1000

        r = await c.post("/v1/completions", content=chunks())
        assert r.status_code == 413
        long = dict(BODY, prompt="hello world " * 60)  # over 50 // 4 characters
        r = await c.post("/v1/completions", json=long)
        assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
        ids = dict(BODY, prompt=[5] * 51)  # token ids are counted exactly
        r = await c.post("/v1/completions", json=ids)
        assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
        for bad in (17, 0, -1, 2.5, "8", True):
            for name in ("max_tokens", "max_completion_tokens"):
                r = await c.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": "hi"}], name: bad})
                assert r.status_code == 400, (name, bad, r.text)
        assert (await c.post("/v1/completions", json=dict(BODY, max_tokens=16))).status_code == 200

    run(make_cfg(tiny_dir, TWO, limits=limits), tokenizer, ups, fn)
    assert len(ups.calls) == 1


def test_a_prompt_is_bounded_by_the_body_not_a_twelfth_of_it(
        tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    """A long-context model's prompts run to several characters per token: a bound of
    one twelfth of the body refused the conversation trace's longest prompts (437k
    characters, 87k tokens) under the default 4 MiB body and a 128k context."""
    ups = Upstreams()
    limits = {"max_body_bytes": 4096, "max_prompt_tokens": 2000}

    async def fn(c: httpx.AsyncClient) -> None:
        prompt = "hello " * 500  # 3000 characters, far above 4096 // 12, 500 tokens
        r = await c.post("/v1/completions", json=dict(BODY, prompt=prompt))
        assert r.status_code == 200, r.text
        r = await c.post("/v1/completions", json=dict(BODY, prompt="hello " * 700))
        assert r.status_code == 413 and "4096" in r.json()["error"]["message"]

    run(make_cfg(tiny_dir, TWO, limits=limits), tokenizer, ups, fn)
    assert len(ups.calls) == 1


def test_concurrency_per_key_is_429_with_retry_after(tiny_dir: str,
                                                     tokenizer: PromptTokenizer) -> None:
    ups = Upstreams(delay_s=0.3)
    limits = {"max_concurrency_per_key": 2, "retry_after_s": 3}

    async def fn(c: httpx.AsyncClient) -> None:
        streamed = dict(BODY, stream=True)
        first = await asyncio.gather(
            *(c.post("/v1/completions", json=streamed if i % 2 else BODY, headers=A)
              for i in range(4)),
            c.post("/v1/completions", json=BODY, headers=B))
        codes = sorted(r.status_code for r in first[:4])
        assert codes == [200, 200, 429, 429], codes
        refused = next(r for r in first[:4] if r.status_code == 429)
        assert refused.headers["retry-after"] == "3"
        assert first[4].status_code == 200  # another tenant has its own budget
        # every slot came back, streamed answers included: two more fit at once
        again = await asyncio.gather(*(c.post("/v1/completions", json=streamed, headers=A)
                                       for _ in range(2)))
        assert [r.status_code for r in again] == [200, 200]
        assert "t2-" in again[0].text

    run(keyed(tiny_dir, limits=limits), tokenizer, ups, fn)
