"""The router never claims a hit it cannot know (issue 30): its block hashes cover token ids
and the cache salt, as the engines' do for plain text, but not what only an engine sees
(a LoRA adapter's files, an image's content hash, prompt embeddings). So requests whose
KV would depend on those are refused with a 4xx and a message, before any upstream call,
instead of being routed on hashes that would name another prompt's blocks."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvcentric.router.tokenize import PromptTokenizer
from tests.router.test_router_app import TWO, Upstreams, make_cfg, run

CHAT = "/v1/chat/completions"
CASES = [
    ("/v1/completions", {"model": "my-lora-adapter", "prompt": "hello", "max_tokens": 2}),
    ("/v1/completions", {"model": "tiny", "prompt_embeds": "AAAA", "max_tokens": 2}),
    ("/v1/completions", {"model": "tiny", "prompt": "hello", "lora_request": {"name": "x"}}),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "multi_modal_data": {"image": "AAAA"}}),
]


@pytest.mark.parametrize("path, body", CASES)
def test_requests_the_router_cannot_key_are_refused_before_any_upstream_call(
        tiny_dir: str, tokenizer: PromptTokenizer, path: str, body: dict[str, Any]) -> None:
    ups = Upstreams()

    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post(path, json=body)
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        assert r.json()["error"]["message"]
        assert ups.calls == []

    run(make_cfg(tiny_dir, TWO), tokenizer, ups, fn)
