"""A hostile tenant against the router, in process (fake engines as in
tests/router/test_router_app.py): each attack of issue 32 is mounted through the router's HTTP
front and shown refused with a 4xx that names why, before any engine or any template runs,
or harmless. The same attacks against a real vLLM CPU engine are in
tests/router/test_router_fuzz_engine.py, schemathesis with every check in it and in
tests/router/test_router_fuzz.py."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from kvcentric.router import tokenize
from kvcentric.router.api.auth import SALT_PREFIX
from kvcentric.router.api.openapi import INSTANCE
from kvcentric.router.config import RouterConfig
from kvcentric.router.tokenize import PromptTokenizer
from tests.router.test_router_app import TWO, Upstreams, make_cfg, run

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "tiny", "prompt": "hello world", "max_tokens": 2}
# a template that, if the router ever rendered it, would spin for hours
SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"


def error(r: httpx.Response) -> dict[str, Any]:
    return dict(r.json()["error"])


@pytest.fixture(scope="module")
def thinking_dir(tiny_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model's tokenizer with a chat template that reads ``enable_thinking``."""
    out = tmp_path_factory.mktemp("thinking")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_dir) / name, out / name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% if enable_thinking is defined and enable_thinking %}<think>"
                            "{% endif %}" + cfg["chat_template"])
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(out)


# ---- item 3: the chat template cannot be replaced, only its declared variables set ----

@pytest.mark.parametrize("body, field", [
    ({**CHAT, "chat_template_kwargs": {"chat_template": SPIN}}, "chat_template"),
    ({**CHAT, "chat_template_kwargs": {"chat_template": "{{ raise_exception('pwned') }}"}},
     "chat_template"),
    ({**CHAT, "chat_template": SPIN}, "chat_template"),
    ({**CHAT, "chat_template_kwargs": {"tokenize": True}}, "tokenize"),
    ({**CHAT, "chat_template_kwargs": {"bos_token": "{{ 7 * 7 }}"}}, "bos_token"),
    ({**CHAT, "chat_template_kwargs": {"enable_thinking": True}}, "enable_thinking"),
])
def test_template_injection_is_refused_before_rendering(
        tiny_dir: str, tokenizer: PromptTokenizer, monkeypatch: pytest.MonkeyPatch,
        body: dict[str, Any], field: str) -> None:
    rendered: list[Any] = []
    monkeypatch.setattr(tokenizer.tok, "apply_chat_template",
                        lambda *a, **kw: rendered.append(kw) or "")
    ups = Upstreams()

    async def fn(c: httpx.AsyncClient) -> None:
        t0 = time.monotonic()
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and field in error(r)["message"], r.text
        assert time.monotonic() - t0 < 5

    run(make_cfg(tiny_dir, TWO), tokenizer, ups, fn)
    assert ups.calls == [] and rendered == []  # no engine saw it, no template ran


def test_declared_template_variables_pass_and_are_published(thinking_dir: str) -> None:
    tok = PromptTokenizer(thinking_dir)
    ups = Upstreams()

    async def fn(c: httpx.AsyncClient) -> None:
        spec = (await c.get("/openapi.json")).json()["components"]["schemas"]
        assert spec["ChatTemplateKwargs"]["additionalProperties"] is False
        assert set(spec["ChatTemplateKwargs"]["properties"]) == {"enable_thinking"}
        for value in (True, False):
            body = {**CHAT, "chat_template_kwargs": {"enable_thinking": value}}
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert ups.calls[-1][2]["chat_template_kwargs"] == {"enable_thinking": value}
        for bad in ({"enable_thinking": {"nested": [1, 2]}}, {"chat_template": "x"},
                    {"enable_thinking": True, "other": 1}):
            r = await c.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": bad})
            assert r.status_code == 400, (bad, r.text)

    run(make_cfg(thinking_dir, TWO), tok, ups, fn)
    assert len(ups.calls) == 2
    assert "<think>" in tok.chat_text({**CHAT, "chat_template_kwargs": {"enable_thinking": True}},
                                      frozenset({"enable_thinking"}))


def test_an_allow_list_replaces_the_template_variables(thinking_dir: str) -> None:
    tok = PromptTokenizer(thinking_dir)
    cfg = make_cfg(thinking_dir, TWO, limits={"chat_template_kwargs": []})

    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/chat/completions",
                         json={**CHAT, "chat_template_kwargs": {"enable_thinking": True}})
        assert r.status_code == 400 and "enable_thinking" in error(r)["message"]

    run(cfg, tok, Upstreams(), fn)
    for bad in (["chat_template"], ["tokenize"], ["messages"], ["not an identifier"], "x"):
        with pytest.raises(ValueError, match="chat_template_kwargs"):
            make_cfg(thinking_dir, TWO, limits={"chat_template_kwargs": bad})


# ---- item 3: sizes are bounded, the rendered prompt before it is tokenised ----

def test_oversize_prompts_are_refused_before_tokenising(
        tiny_dir: str, tokenizer: PromptTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    encoded: list[int] = []
    real = tokenize.PromptTokenizer.run

    def spy(self: PromptTokenizer, plan: tokenize.Plan) -> Any:
        encoded.append(len(plan.text))
        return real(self, plan)

    monkeypatch.setattr(tokenize.PromptTokenizer, "run", spy)
    ups = Upstreams()
    limits = {"max_model_len": 64, "max_body_bytes": "1mb"}  # 63 tokens, 441 characters

    async def fn(c: httpx.AsyncClient) -> None:
        # many messages, each within the schema: the rendered chat is over the bound
        msgs = [{"role": "user", "content": "word " * 80} for _ in range(8)]
        r = await c.post("/v1/chat/completions", json={**CHAT, "messages": msgs})
        assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded"
        assert "characters" in error(r)["message"] and encoded == []
        # one prompt over the schema's character bound
        r = await c.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 442})
        assert r.status_code == 400 and "prompt" in error(r)["message"] and encoded == []
        # within the characters, over the tokens: refused after tokenising
        r = await c.post("/v1/completions", json={**COMPLETION, "prompt": "a b " * 100})
        assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded"
        assert "input tokens" in error(r)["message"] and len(encoded) == 1
        # token ids: 63 pass (one left for the answer), 64 do not
        r = await c.post("/v1/completions", json={**COMPLETION, "prompt": [5] * 64})
        assert r.status_code == 400
        r = await c.post("/v1/completions", json={**COMPLETION, "prompt": [5] * 63,
                                                  "max_tokens": 64, "min_tokens": 10})
        assert r.status_code == 200, r.text
        # vLLM's rules: a budget above the context is clamped, min_tokens to what is left
        assert ups.calls[-1][2]["max_tokens"] == 64 and ups.calls[-1][2]["min_tokens"] == 1

    run(make_cfg(tiny_dir, TWO, limits=limits), tokenizer, ups, fn)
    assert len(ups.calls) == 1


def test_limits_are_on_by_default_and_follow_the_engines_context(
        tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    """No limits configured: the context is the model's (config.json: 16384) until the
    engines report theirs (/v1/models: 100 here), and 256 requests per known instance in
    flight, no fixed bound per key."""
    cfg = make_cfg(tiny_dir, TWO)
    assert cfg.limits.max_concurrency_per_key is None and cfg.limits.max_prompt_tokens is None
    assert cfg.limits.max_concurrency_per_instance == 256
    ups = Upstreams()
    handler = ups.handler

    async def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 100}]})
        return await handler(request)

    ups.handler = engine  # type: ignore[method-assign]

    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={**COMPLETION, "prompt": [7] * 100})
        assert r.status_code == 400 and "maximum context length is 100" in error(r)["message"]
        assert (await c.post("/v1/completions", json={**COMPLETION, "prompt": [7] * 99})
                ).status_code == 200
        assert (await c.get("/v1/models")).json()["data"][0]["max_model_len"] == 100
        spec = (await c.get("/openapi.json")).json()["components"]["schemas"]
        assert spec["CompletionRequest"]["properties"]["prompt"]["anyOf"][1]["maxItems"] == 16383

    run(cfg, tokenizer, ups, fn)


# ---- item 3: every forwarded field is bounded as vLLM bounds it ----

EXTREME = [
    ("prompt_logprobs", 21), ("prompt_logprobs", -1), ("prompt_logprobs", 10**30),
    ("logprobs", 21), ("logprobs", -1), ("priority", 1), ("priority", -(2**63)),
    ("n", 5), ("n", 0), ("max_tokens", 16385), ("min_tokens", 10**9), ("temperature", 2.5),
    ("temperature", -0.1), ("top_p", 0), ("top_k", -2), ("top_k", 2**40), ("min_p", 1.5),
    ("seed", 2**64), ("repetition_penalty", 0), ("presence_penalty", 3),
    ("stop_token_ids", [4096]), ("stop", [""]), ("kv_transfer_params", {"do_remote": True}),
    ("vllm_xargs", {"a": 1}), ("request_id", "victim-1"), ("prompt_embeds", "AAAA"),
    ("response_format", {"type": "json_object"}), ("echo", "yes"), ("cache_salt", "a/b"),
]


@pytest.mark.parametrize("field, value", EXTREME)
def test_extreme_fields_never_reach_the_engine(tiny_dir: str, tokenizer: PromptTokenizer,
                                               field: str, value: Any) -> None:
    ups = Upstreams()

    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={**COMPLETION, field: value})
        assert r.status_code == 400 and field in error(r)["message"], r.text

    run(make_cfg(tiny_dir, TWO), tokenizer, ups, fn)
    assert ups.calls == []


def test_joined_fields_and_non_json_numbers(tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    ups = Upstreams()

    async def fn(c: httpx.AsyncClient) -> None:
        for body, path in (({**COMPLETION, "stream": True, "prompt_logprobs": 1},
                            "/v1/completions"),
                           ({**CHAT, "top_logprobs": 2}, "/v1/chat/completions"),
                           ({**CHAT, "top_logprobs": 2, "logprobs": False},
                            "/v1/chat/completions")):
            r = await c.post(path, json=body)
            assert r.status_code == 400, (body, r.text)
        r = await c.post("/v1/completions", content=b'{"prompt": "x", "temperature": NaN}',
                         headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in error(r)["message"]
        ok = [({**COMPLETION, "prompt_logprobs": 20, "logprobs": 20, "n": 4, "priority": 0,
                "temperature": 2, "top_p": 1, "top_k": -1, "min_p": 0, "seed": -(2**63),
                "stop_token_ids": [4095], "stream": False}, "/v1/completions"),
              ({**COMPLETION, "stream": True, "prompt_logprobs": 0}, "/v1/completions"),
              ({**CHAT, "logprobs": True, "top_logprobs": 20}, "/v1/chat/completions")]
        for body, path in ok:
            r = await c.post(path, json=body)
            assert r.status_code == 200, (body, r.text)
            assert ups.calls[-1][2] == body

    run(make_cfg(tiny_dir, TWO), tokenizer, ups, fn)


# ---- item 3: the in-flight bound comes before the body ----

class HeldUpstreams(Upstreams):
    """Completions reach the fake engine (``arrived``) and wait there until ``release``
    is set: a request holds its slot for as long as the test says, not a guessed time."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived = 0
        self.release: asyncio.Event | None = None  # made in the test's event loop

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/completions"):
            self.arrived += 1
            self.release = self.release or asyncio.Event()
            await self.release.wait()
        return await super().handler(request)


def test_in_flight_bound_refuses_before_reading_the_body(tiny_dir: str,
                                                         tokenizer: PromptTokenizer) -> None:
    ups = HeldUpstreams()
    read: list[int] = []

    async def body() -> Any:
        read.append(1)
        yield json.dumps(COMPLETION).encode()

    async def fn(c: httpx.AsyncClient) -> None:
        first = asyncio.create_task(c.post("/v1/completions", json=COMPLETION))
        deadline = asyncio.get_running_loop().time() + 30
        while ups.arrived < 1:  # the first holds the only slot: it reached the engine
            assert asyncio.get_running_loop().time() < deadline, "the first never arrived"
            await asyncio.sleep(0.01)
        r = await asyncio.wait_for(c.post("/v1/completions", content=body(),
                                          headers={"content-type": "application/json"}), 30)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert read == []  # refused from the headers alone
        assert ups.release is not None
        ups.release.set()
        assert (await first).status_code == 200
        r = await c.post("/v1/completions", content=body(),
                         headers={"content-type": "application/json"})
        assert r.status_code == 200 and read == [1]  # the slot came back

    run(make_cfg(tiny_dir, TWO, limits={"max_concurrency_per_key": 1}), tokenizer, ups, fn)


def test_in_flight_bound_per_instance_scales_with_the_fleet(tiny_dir: str,
                                                            tokenizer: PromptTokenizer) -> None:
    """One request per instance: with two instances two are held at the engines at once,
    the third is refused naming the bound the fleet makes (2), and a slot coming back
    admits one again."""
    ups = HeldUpstreams()

    async def fn(c: httpx.AsyncClient) -> None:
        held = [asyncio.create_task(c.post("/v1/completions", json=COMPLETION))
                for _ in range(2)]
        deadline = asyncio.get_running_loop().time() + 30
        while ups.arrived < 2:  # both reached an engine: both slots are taken
            assert asyncio.get_running_loop().time() < deadline, "the two never arrived"
            await asyncio.sleep(0.01)
        r = await asyncio.wait_for(c.post("/v1/completions", json=COMPLETION), 30)
        assert r.status_code == 429 and "(limit 2)" in error(r)["message"]
        assert ups.release is not None
        ups.release.set()
        assert [(await t).status_code for t in held] == [200, 200]
        assert (await c.post("/v1/completions", json=COMPLETION)).status_code == 200

    run(make_cfg(tiny_dir, TWO, limits={"max_concurrency_per_instance": 1}), tokenizer, ups,
        fn)


# ---- item 3: instances added at run time ----

def test_an_unreachable_instance_takes_no_traffic(tiny_dir: str,
                                                  tokenizer: PromptTokenizer) -> None:
    ups = Upstreams()
    handler = ups.handler
    dead = httpx.ConnectError("connection refused")

    async def engines(request: httpx.Request) -> httpx.Response:
        if request.url.host.startswith("dead"):
            ups.calls.append((request.url.host, request.url.path, {}))
            raise dead
        return await handler(request)

    ups.handler = engines  # type: ignore[method-assign]
    cfg = make_cfg(tiny_dir, [TWO[0]], upstream={"retries": 0})

    async def fn(c: httpx.AsyncClient) -> None:
        for i in range(3):
            r = await c.post("/instances", json={"url": f"http://dead{i}:9", "name": f"d{i}"})
            assert r.status_code == 201 and r.json()["healthy"] is False
        rs = await asyncio.gather(*(c.post("/v1/completions", json={
            **COMPLETION, "prompt": [i + 5] * 300}) for i in range(12)))
        assert [r.status_code for r in rs] == [200] * 12
        assert {r.headers["x-kvc-decode"] for r in rs} == {"a"}
        assert (await c.get("/health")).json()["prefill"] == 1

    run(cfg, tokenizer, ups, fn)
    assert {p for h, p, _ in ups.calls if h.startswith("dead")} == {"/health"}


def test_an_upstream_that_cannot_be_reached_is_retried_on_a_healthy_one(
        tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    """Healthy at its last check, refusing connections now: with no retries configured the
    request still goes to the other engine (the first never saw it), not to a 502."""
    ups = Upstreams(fail={"a": httpx.ConnectError("refused"), "c": httpx.ConnectError("x")})
    three = [*TWO, {"url": "http://c:1", "name": "c"}]

    async def fn(c: httpx.AsyncClient) -> None:
        for i in range(4):
            r = await c.post("/v1/completions", json={**COMPLETION, "prompt": [9 + i] * 300})
            assert r.status_code == 200 and r.headers["x-kvc-decode"] == "b", r.text

    run(make_cfg(tiny_dir, three, upstream={"retries": 0}), tokenizer, ups, fn)
    ups = Upstreams(fail={"a": 500, "b": 500})  # engines that saw it: the budget applies

    async def fn502(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 502 and len(ups.calls) == 1

    run(make_cfg(tiny_dir, TWO, upstream={"retries": 0}), tokenizer, ups, fn502)


@pytest.mark.parametrize("spec", [
    {"url": "https://jag:65/*"}, {"url": "http://a:1", "model": "\ud800x"},
    {"url": "http://a:1", "model": "a b"}, {"url": "http://a:1", "name": "a\n"},
    {"url": "http://a:1\n"}, {"url": "http://a:70000"}, {"url": "http://a:0"},
    {"url": 5}, {"url": "http://a:1", "role": 1}, {"url": "http://a:1", "name": 3},
    {"url": "http://a:1", "extra": 1}, {"url": "http://a:1", "kv_events_replay": "ipc:///x"},
    {"url": "http://a:1", "kv_events": "ipc:///tmp/\ud800"}, {"url": None}, {},
])
def test_post_instances_refuses_what_its_schema_refuses(tiny_dir: str,
                                                        tokenizer: PromptTokenizer,
                                                        spec: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(spec, INSTANCE)

    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post("/instances", content=json.dumps(spec).encode(),
                         headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert len((await c.get("/instances")).json()["instances"]) == 2

    run(make_cfg(tiny_dir, TWO), tokenizer, Upstreams(), fn)


def test_post_instances_accepts_what_its_schema_accepts(tiny_dir: str,
                                                        tokenizer: PromptTokenizer) -> None:
    ok = [{"url": "http://c:1/"}, {"url": "https://x.example:65535", "name": "x",
                                   "model": "tiny", "compute": "gpu0"},
          {"url": "http://e:2", "kv_events": "inproc://e", "kv_events_replay": "inproc://r",
           "role": "decode"}, {"url": "http://f", "name": None, "model": None}]

    async def fn(c: httpx.AsyncClient) -> None:
        for spec in ok:
            jsonschema.validate(spec, INSTANCE)
            r = await c.post("/instances", json=spec)
            assert r.status_code == 201, (spec, r.text)
            assert r.json()["healthy"] is True  # the fake engines answer /health

    run(make_cfg(tiny_dir, TWO), tokenizer, Upstreams(), fn)


# ---- item 4: observability without leaks ----

KEYS = {"sk-team-a-0001": "team-a"}
ADMIN, METRICS = "sk-admin-9999", "sk-metrics-777"


def _basic(password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"prom:{password}".encode()).decode()}


def test_metrics_and_dashboard_need_the_admin_or_metrics_key(
        tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    auth = {"api_keys": KEYS, "admin_key": ADMIN, "metrics_key": METRICS,
            "salt_secret": "s" * 32}

    async def fn(c: httpx.AsyncClient) -> None:
        for path in ("/metrics", "/dashboard"):
            for headers in ({}, {"Authorization": "Bearer nope-nope-nope"}, _basic("nope")):
                r = await c.get(path, headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.headers["www-authenticate"].startswith("Basic")  # a browser asks
                assert "kvc_router" not in r.text and "hot" not in r.text.lower()
            r = await c.get(path, headers={"Authorization": "Bearer sk-team-a-0001"})
            assert r.status_code == 403
            for headers in ({"Authorization": f"Bearer {ADMIN}"},
                            {"Authorization": f"Bearer {METRICS}"}, _basic(METRICS)):
                assert (await c.get(path, headers=headers)).status_code == 200
        r = await c.get("/metrics", headers={"Authorization": f"Bearer {METRICS}"})
        assert "kvc_router_" in r.text
        # the metrics key opens nothing else
        assert (await c.get("/instances", headers={"Authorization": f"Bearer {METRICS}"})
                ).status_code == 401
        assert (await c.post("/v1/completions", json=COMPLETION,
                             headers={"Authorization": f"Bearer {METRICS}"})).status_code == 401
        doc = (await c.get("/openapi.json")).json()
        assert doc["paths"]["/metrics"]["get"]["security"] == [{"bearer": []}, {"basic": []}]

    run(make_cfg(tiny_dir, TWO, auth=auth), tokenizer, Upstreams(), fn)


def test_metrics_closed_without_a_reader_key_and_open_without_keys(
        tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    async def closed(c: httpx.AsyncClient) -> None:
        r = await c.get("/metrics", headers={"Authorization": "Bearer sk-team-a-0001"})
        assert r.status_code == 403 and "metrics_key" in error(r)["message"]

    run(make_cfg(tiny_dir, TWO, auth={"api_keys": KEYS}), tokenizer, Upstreams(), closed)

    async def admin_only(c: httpx.AsyncClient) -> None:  # an admin key alone closes them too
        assert (await c.get("/metrics")).status_code == 401
        assert (await c.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
                ).status_code == 200

    run(make_cfg(tiny_dir, TWO, auth={"admin_key": ADMIN}), tokenizer, Upstreams(), admin_only)

    async def open_(c: httpx.AsyncClient) -> None:  # loopback, no keys: open as before
        assert (await c.get("/metrics")).status_code == 200
        assert (await c.get("/dashboard")).status_code == 200

    run(make_cfg(tiny_dir, TWO), tokenizer, Upstreams(), open_)


def test_tenant_salts_are_keyed_with_the_server_secret(
        tiny_dir: str, tokenizer: PromptTokenizer, tmp_path: Path) -> None:
    secret = "a-salt-secret-of-32-characters!!"
    (tmp_path / "salt").write_text(secret + "\n")
    salts = []
    for auth, env in (({"salt_secret": secret}, {}),
                      ({"salt_secret_file": str(tmp_path / "salt")}, {}),
                      ({}, {"KVCENTRIC_ROUTER_SALT_SECRET": secret}),
                      ({"salt_secret": "another-secret-of-32-characters!"}, {})):
        raw = {"model": "tiny", "tokenizer": tiny_dir, "instances": TWO,
               "health": {"interval_s": 30}, "keys": {"block_size": 256},
               "auth": {"api_keys": KEYS, **auth}}
        ups = Upstreams()

        async def fn(c: httpx.AsyncClient) -> None:
            r = await c.post("/v1/completions", json=COMPLETION,
                             headers={"Authorization": "Bearer sk-team-a-0001"})
            assert r.status_code == 200

        run(RouterConfig.from_dict(raw, env), tokenizer, ups, fn)
        salts.append(ups.calls[0][2]["cache_salt"])
    want = SALT_PREFIX + hmac.new(secret.encode(), b"team-a", hashlib.sha256).hexdigest()[:16]
    assert salts[:3] == [want] * 3 and salts[3] != want
    # the old unkeyed salt is gone: a guess of the tenant name no longer gives it
    assert SALT_PREFIX + hashlib.sha256(b"team-a").hexdigest()[:16] not in salts
    for bad in ({"salt_secret": "short"}, {"salt_secret_file": str(tmp_path / "missing")},
                {"metrics_key": "sk-team-a-0001"}, {"metrics_key": ADMIN, "admin_key": ADMIN}):
        with pytest.raises(ValueError, match="auth"):
            RouterConfig.from_dict({"model": "tiny", "tokenizer": tiny_dir,
                                    "auth": {"api_keys": KEYS, **bad}})
