"""Inputs beyond token ids, end to end on real vLLM CPU servers and a real local store.

LoRA adapters (random, made on the fly, ``--enable-lora``) and prompt embeddings
(``--enable-prompt-embeds``) change a prompt's KV without changing its token ids (those of
embeddings are placeholders). The same prompt under two adapters, or two embeddings of
one length, never share KV; the same adapter or the same embeddings do. ``base`` serves
the reference tokens without a connector; ``kvc`` is kv_both on the store.
"""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kvcentric.config import StoreConfig
from kvcentric.store.local import launcher
from kvcentric.testing.adapters import build_lora
from kvcentric.testing.models import build_model, get_spec
from kvcentric.testing.servers import VllmServer, connector_config
from tests.helpers.e2e_store import e2e_store

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def servers(runtime_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[VllmServer, VllmServer]]:
    model = str(build_model("tiny", Path.cwd() / ".models" / "tiny"))
    adapters = tmp_path_factory.mktemp("adapters")
    a, b = build_lora("tiny", adapters / "a", seed=1), build_lora("tiny", adapters / "b", seed=2)
    args = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
            "--lora-modules", f"a={a}", f"b={b}", "--enable-prompt-embeds")
    store = e2e_store("vllm-inputs", "256mb", runtime_dir)
    logs = tmp_path_factory.mktemp("inputs-logs")
    base = VllmServer(model, args=args, log_path=logs / "base.log")
    kvc = VllmServer(model, args=args, log_path=logs / "kvc.log",
                     kv_transfer=connector_config(store))
    try:
        for s in (base, kvc):
            s.start()
        for s in (base, kvc):
            s.wait_ready()
        yield base, kvc
    finally:
        base.stop()
        kvc.stop()
        launcher.stop(StoreConfig.from_dict(store))


def hits(server: VllmServer) -> float:
    return server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)


def prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(4, 4000) for _ in range(n)]


def embeds(seed: int, n: int) -> str:
    """``n`` random prompt embeddings of the tiny model, as vLLM takes them (base64 of a
    ``torch.save``'d float32 tensor ``[n, hidden_size]``)."""
    gen = torch.Generator().manual_seed(seed)
    buf = io.BytesIO()
    torch.save(torch.randn(n, get_spec("tiny").hidden_size, generator=gen), buf)
    return base64.b64encode(buf.getvalue()).decode()


def embed_tokens(server: VllmServer, data: str, max_tokens: int = 12) -> list[int]:
    body: dict[str, Any] = {"model": server.name, "prompt_embeds": data,
                            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                            "return_token_ids": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


def test_the_same_prompt_under_two_adapters_never_shares_kv(
        servers: tuple[VllmServer, VllmServer]) -> None:
    base, kvc = servers
    p = prompt(11, 700)
    want = {m: base.tokens(p, model=m) for m in ("a", "b", "tiny")}
    assert len({tuple(t) for t in want.values()}) == 3  # each adapter changes the tokens
    assert kvc.tokens(p, model="a") == want["a"]  # adapter a's KV goes to the store
    for other in ("b", "tiny"):
        kvc.reset_prefix_cache()
        before = hits(kvc)
        assert kvc.tokens(p, model=other) == want[other]
        assert hits(kvc) == before, other
    kvc.reset_prefix_cache()
    before = hits(kvc)
    assert kvc.tokens(p, model="a") == want["a"]
    assert hits(kvc) - before == len(p) - 1  # the same adapter shares every block and tail


def test_two_embeddings_of_one_length_never_share_kv(
        servers: tuple[VllmServer, VllmServer]) -> None:
    base, kvc = servers
    n = 600
    e1, e2 = embeds(1, n), embeds(2, n)
    want1, want2 = embed_tokens(base, e1), embed_tokens(base, e2)
    assert want1 != want2
    assert embed_tokens(kvc, e1) == want1
    kvc.reset_prefix_cache()
    before = hits(kvc)
    assert embed_tokens(kvc, e2) == want2
    assert hits(kvc) == before  # same placeholder token ids, other embeddings: no hit
    kvc.reset_prefix_cache()
    before = hits(kvc)
    assert embed_tokens(kvc, e1) == want1
    assert hits(kvc) - before == n - 1
