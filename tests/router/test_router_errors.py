"""Errors a user can act on (issue 49): each names what is wrong, where, and what would be
right, and carries the size of what was sent; never a regex, never silence.

The router app runs in process with fake engines (httpx.MockTransport), as in
tests/router/test_router_app.py: what is checked is the router's own answers and logs."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from kvcentric.router.config import RouterConfig
from kvcentric.router.fleet.instance_spec import InstanceSpec
from kvcentric.router.fleet.instances import Registry
from kvcentric.router.fleet.prefix_index import PrefixIndex
from kvcentric.router.tokenize import PromptTokenizer
from tests.router.test_router_app import TWO, Upstreams, make_cfg, run

COMPLETION = {"model": "tiny", "prompt": "hello world", "max_tokens": 2}
REFUSED = "[Errno 111] Connection refused"


@dataclass
class Down(Upstreams):
    """Fake engines of which those in ``down`` refuse every connection."""

    down: set[str] = field(default_factory=set)

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.host in self.down:
            raise httpx.ConnectError(REFUSED, request=request)
        return await super().handler(request)


def error(r: httpx.Response) -> dict[str, Any]:
    return dict(r.json()["error"])


# ---- health checks: logged with URL and reason, shown in /instances, /health, the 503 ----

def test_a_down_instance_is_logged_at_once_and_explained_everywhere(
        tiny_dir: str, tokenizer: PromptTokenizer, caplog: pytest.LogCaptureFixture) -> None:
    ups = Down(down={"a"})
    one = [{"url": "http://a:1", "name": "a"}]  # role both: it would prefill if it answered

    async def fn(c: httpx.AsyncClient) -> None:
        # the first failed check is logged (it joined out of rotation: no healthy->unhealthy)
        logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                  and "instance a" in r.getMessage()]
        assert logged and "http://a:1" in logged[0] and REFUSED in logged[0], logged
        inst = (await c.get("/instances")).json()["instances"][0]
        assert inst["healthy"] is False and REFUSED in inst["last_error"]
        assert inst["last_error"].startswith("GET /health failed: ConnectError")
        h = await c.get("/health")
        assert h.status_code == 503
        down = h.json()["unhealthy"]
        assert down == [{"name": "a", "role": "both", "url": "http://a:1",
                         "last_error": inst["last_error"]}]
        assert "no healthy instance that can prefill" in h.json()["reason"]
        r = await c.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 503
        msg = error(r)["message"]
        assert msg.startswith("no healthy instance that can prefill: a (http://a:1), role "
                              "both: GET /health failed: ConnectError"), msg
        assert REFUSED in msg

    with caplog.at_level(logging.WARNING, logger="router.fleet.instances"):
        run(make_cfg(tiny_dir, one), tokenizer, ups, fn)


def test_the_503_names_each_instance_and_hides_urls_from_keyed_clients(
        tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    ups = Down(down={"a"})
    insts = [{"url": "http://a:1", "name": "a"},
             {"url": "http://b:1", "name": "b", "role": "decode"}]
    key = "sk-tenant-key"

    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json=COMPLETION,
                         headers={"authorization": f"Bearer {key}"})
        msg = error(r)["message"]
        assert r.status_code == 503 and "a, role both: GET /health failed" in msg, msg
        assert "b, role decode: role decode does not prefill" in msg
        assert "http://" not in msg  # a tenant is no operator: URLs are in /instances
        h = (await c.get("/health")).json()
        assert h["unhealthy"][0] == {"name": "a", "role": "both",
                                     "last_error": h["unhealthy"][0]["last_error"]}

    run(make_cfg(tiny_dir, insts, auth={"api_keys": {key: "t"}}), tokenizer, ups, fn)


def test_failures_are_logged_first_and_then_once_per_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    reg = Registry(PrefixIndex(), 16, log_interval_s=60.0)
    inst = reg.add(InstanceSpec("http://a:1", name="a"), healthy=False)
    with caplog.at_level(logging.WARNING, logger="router.fleet.instances"):
        for t in (0.0, 1.0, 30.0, 59.0, 60.0, 61.0, 125.0):
            reg.mark_failed(inst, 2, f"GET /health failed: down at {t}", now=t)
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 3, logged  # t=0 (first), t=60, t=125
    assert "down at 0.0" in logged[0] and "http://a:1" in logged[0]
    assert "down at 60.0" in logged[1] and "5 in a row" in logged[1]
    assert "down at 125.0" in logged[2]
    reg.mark_ok(inst)
    assert inst.last_error is None and inst.healthy
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="router.fleet.instances"):
        reg.mark_failed(inst, 2, "GET /health answered 500", now=126.0)
    assert [r.getMessage() for r in caplog.records] == [
        "instance a (http://a:1) failing (1 in a row, in rotation): GET /health answered 500"]


def test_no_instances_at_all_says_so(tiny_dir: str, tokenizer: PromptTokenizer) -> None:
    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 503 and "no instances are configured" in error(r)["message"]

    run(make_cfg(tiny_dir, []), tokenizer, Upstreams(), fn)


# ---- instance specs: the field and its expected form, never the pattern ----

@pytest.mark.parametrize("spec, words", [
    ({"url": "localhost:8100"}, "instance url 'localhost:8100' must be http://HOST[:PORT] or "
                                "https://HOST[:PORT], no path (e.g. http://127.0.0.1:8100); "
                                "did you mean http://localhost:8100?"),
    ({"url": "http://a:1/v1"}, "instance url 'http://a:1/v1' must be http://HOST[:PORT]"),
    ({"url": "http://a:1", "kv_events": "tcp://a"},
     "instance kv_events 'tcp://a' must be tcp://HOST:PORT (the router binds)"),
    ({"url": "http://a:1", "name": "a b"}, "instance name 'a b' must be 1 to 64 letters"),
])
def test_instance_fields_say_the_expected_form(spec: dict[str, str], words: str) -> None:
    with pytest.raises(ValueError) as err:
        InstanceSpec.from_dict(spec)
    assert words in str(err.value)
    assert "(?!" not in str(err.value) and "[A-Za-z" not in str(err.value)


def test_post_instances_without_scheme_names_the_field(tiny_dir: str,
                                                       tokenizer: PromptTokenizer) -> None:
    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post("/instances", json={"url": "127.0.0.1:8100"})
        assert r.status_code == 400
        assert error(r)["message"].startswith("instance url '127.0.0.1:8100' must be "
                                              "http://HOST[:PORT]"), r.text
        assert "did you mean http://127.0.0.1:8100?" in error(r)["message"]

    run(make_cfg(tiny_dir, TWO), tokenizer, Upstreams(), fn)


# ---- requests past the limits: context_length_exceeded, invalid token id, sizes ----

def test_prompts_past_the_limits_get_the_documented_errors(tiny_dir: str,
                                                           tokenizer: PromptTokenizer) -> None:
    ups = Upstreams()

    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={**COMPLETION, "prompt": [5] * 16384})
        assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded", r.text
        assert "your prompt contains 16384 input tokens" in error(r)["message"]
        vocab = tokenizer.vocab_size
        r = await c.post("/v1/completions", json={**COMPLETION, "prompt": [5, 6, vocab]})
        assert r.status_code == 400, r.text
        assert error(r)["message"] == (f"prompt.2: invalid token id {vocab}: the vocabulary "
                                       f"has ids 0 to {vocab - 1}")
        r = await c.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 120_000})
        assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded", r.text
        assert "your prompt (field prompt) contains 120000 characters (more than" \
            in error(r)["message"]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 120_000}]}
        r = await c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded", r.text
        assert "(field messages.0.content) contains 120000 characters" in error(r)["message"]
        r = await c.post("/v1/completions", json={**COMPLETION, "stop_token_ids": [vocab + 7]})
        assert error(r)["message"].startswith(f"stop_token_ids.0: invalid token id {vocab + 7}")
        assert ups.calls == []

    run(make_cfg(tiny_dir, TWO), tokenizer, ups, fn)


@pytest.mark.parametrize("extra, words", [
    ({"max_tokens": 10**9}, "max_tokens: Input should be less than or equal to"),
    ({"max_tokens": 10**9}, "; got 1000000000"),
    ({"cache_salt": "a/b"}, "cache_salt: must not contain '@', '/', '\\' or a NUL character; "
                            "got 3 characters"),
    ({"stop": ["x" * 100]}, "stop.0: String should have at most 64 characters; got 100 "
                            "characters"),
    ({"stop": ["x"] * 5}, "stop: List should have at most 4 items after validation, not 5; "
                          "got 5 items"),
    ({"temperature": 7}, "temperature: Input should be less than or equal to 2; got 7"),
    ({"user": "u" * 300}, "user: String should have at most 256 characters; got 300 "
                          "characters"),
    ({"bogus": 1}, "bogus: Extra inputs are not permitted"),
])
def test_validation_errors_name_the_field_the_limit_and_the_size(
        tiny_dir: str, tokenizer: PromptTokenizer, extra: dict[str, Any], words: str) -> None:
    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={**COMPLETION, **extra})
        assert r.status_code == 400, r.text
        msg = error(r)["message"]
        assert words in msg, msg
        assert "pattern" not in msg and "^[" not in msg and "constrained" not in msg

    run(make_cfg(tiny_dir, TWO), tokenizer, Upstreams(), fn)


# ---- the pinned block size against what the engines store ----

@pytest.mark.parametrize("pinned, words", [
    (256, "keys.block_size 256 differs from the 128-token blocks the connector stores by "
          "default for the engine's page of 128 tokens"),
    (200, "keys.block_size 200 is not a multiple of the engine's page of 128 tokens"),
])
def test_a_pinned_block_size_no_engine_stores_is_warned_naming_both(
        tiny_dir: str, tokenizer: PromptTokenizer, caplog: pytest.LogCaptureFixture,
        pinned: int, words: str) -> None:
    async def fn(c: httpx.AsyncClient) -> None:
        assert (await c.get("/instances")).json()["keys"]["block_size"] == pinned

    with caplog.at_level(logging.WARNING, logger="router.api.app"):
        run(make_cfg(tiny_dir, TWO, keys={"block_size": pinned}), tokenizer, Upstreams(), fn)
    logged = [r.getMessage() for r in caplog.records if "keys.block_size" in r.getMessage()]
    assert len(logged) == 2 and all(words in m for m in logged), logged  # once per instance
    assert "instance a (http://a:1)" in logged[0] + logged[1]


def test_the_default_block_size_warns_nothing(tiny_dir: str, tokenizer: PromptTokenizer,
                                              caplog: pytest.LogCaptureFixture) -> None:
    async def fn(c: httpx.AsyncClient) -> None:
        assert (await c.get("/instances")).json()["keys"]["block_size"] == 128

    with caplog.at_level(logging.WARNING, logger="router.api.app"):
        run(make_cfg(tiny_dir, TWO, keys={"block_size": None}), tokenizer, Upstreams(), fn)
    assert not [r for r in caplog.records if "keys.block_size" in r.getMessage()]


# ---- API keys: the field and the minimum ----

@pytest.mark.parametrize("auth, words", [
    ({"api_keys": {"short": "team-a"}}, "auth.api_keys (or KVCENTRIC_ROUTER_API_KEYS): the "
                                        "key of tenant 'team-a' has 5 characters; a key "
                                        "needs at least 8"),
    ({"api_keys": {"long-enough-key": "team a"}}, "auth.api_keys (or KVCENTRIC_ROUTER_API_KEYS)"
                                                  ": tenant 'team a' must be 1 to 64 letters"),
    ({"admin_key": "adm"}, "auth.admin_key has 3 characters; it needs at least 8"),
    ({"metrics_key": "m"}, "auth.metrics_key has 1 characters; it needs at least 8"),
])
def test_short_keys_name_their_field_and_the_minimum(tiny_dir: str, auth: dict[str, Any],
                                                     words: str) -> None:
    with pytest.raises(ValueError) as err:
        RouterConfig.from_dict({"model": "tiny", "tokenizer": tiny_dir, "auth": auth})
    assert words in str(err.value)
    assert "short" not in str(err.value)  # the key itself is never echoed


# ---- /docs: nothing from a CDN; it says why and where the document is ----

def test_docs_load_nothing_from_elsewhere_and_say_why(tiny_dir: str,
                                                      tokenizer: PromptTokenizer) -> None:
    async def fn(c: httpx.AsyncClient) -> None:
        for path in ("/docs", "/redoc"):
            r = await c.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            page = r.text
            assert "<script" not in page and "cdn" not in page.replace("a CDN", "")
            assert "href='/openapi.json'" in page and "Swagger UI 4" in page
            assert "<code>/v1/completions</code>" in page and "<code>POST</code>" in page
        assert "/docs" not in (await c.get("/openapi.json")).json()["paths"]

    run(make_cfg(tiny_dir, TWO), tokenizer, Upstreams(), fn)


@pytest.mark.parametrize("section, value, words", [
    ("health", {"interval_s": -1}, "health.interval_s must be a positive number, got -1.0"),
    ("slo", {"ttft_ms": 0}, "slo.ttft_ms must be a positive number, got 0.0"),
    ("limits", {"max_n": 0}, "limits.max_n must be a positive number, got 0"),
])
def test_config_numbers_are_named_as_the_yaml_names_them(tiny_dir: str, section: str,
                                                         value: dict[str, Any],
                                                         words: str) -> None:
    with pytest.raises(ValueError) as err:
        RouterConfig.from_dict({"model": "tiny", "tokenizer": tiny_dir, section: value})
    assert str(err.value) == words
