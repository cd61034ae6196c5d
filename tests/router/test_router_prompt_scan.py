"""A text prompt is tokenised only up to its first block held nowhere, and what is
tokenised is exactly what a whole tokenisation gives (``router/prompt_scan.py``).

Real tokenizers as in test_router_prefix_tokens.py (the bench model's byte-level BPE and
trained Llama-3-style and SentencePiece-style ones); the router-level behaviour (a long
prompt through the app, the context check that still needs the exact count) is in
test_router_app.py's style at the end.
"""

from __future__ import annotations

import asyncio
import random
import unicodedata
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvcentric.router.cost.decision import Rejection
from kvcentric.router.fleet.replication import HotPrefixes
from kvcentric.router.prompt_scan import scan
from kvcentric.router.tokenize import PromptTokenizer
from tests.router.test_router_prefix_tokens import bench, mixed_text, trained

PIECE = 4096


def quiet(tok: PromptTokenizer) -> PromptTokenizer:
    """No sampled whole-tokenisation checks: the scan's own ids must match."""
    assert tok.prefix is not None
    tok.prefix._verify_first = 0
    tok.prefix._verify_every = 1 << 30
    return tok


def held_up_to(n: int) -> tuple[list[int], object]:
    """A ``held`` that says yes while fewer than ``n`` tokens are asked about; it records
    how many it was asked about."""
    asked: list[int] = []

    async def held(ids: np.ndarray) -> bool:
        asked.append(len(ids))
        return len(ids) < n

    return asked, held


@pytest.mark.parametrize("kind", ["bench", "llama3", "metaspace"])
def test_a_scan_stops_at_the_first_block_held_nowhere_with_exact_ids(tmp_path: Path,
                                                                       kind: str) -> None:
    path = bench() if kind == "bench" else trained(tmp_path, kind)
    tok = quiet(PromptTokenizer(path, cache_chars=1 << 22))
    text = mixed_text(random.Random(7), 12000)  # ~50k characters
    for special in (True, False):
        whole = np.asarray(tok.tok(text, add_special_tokens=special)["input_ids"],
                           dtype=np.uint32)
        asked, held = held_up_to(len(whole) // 3)
        before = tok.prefix.tokenized_tokens  # type: ignore[union-attr]
        got = asyncio.run(scan(tok, tok.plan(text, special), held, PIECE))  # type: ignore[arg-type]
        assert not got.complete and 0 < len(got.tokens) < len(whole)
        assert np.array_equal(got.tokens, whole[:len(got.tokens)])  # exact where it stops
        assert len(got.tokens) >= len(whole) // 3 and asked[-1] == len(got.tokens)
        # the rest is estimated from the characters left: a rough count, not a wild one
        assert 0.7 < got.n_tokens / len(whole) < 1.3, (got.n_tokens, len(whole))
        # and it was never tokenised: about one piece past the stop point at most
        spent = tok.prefix.tokenized_tokens - before  # type: ignore[union-attr]
        assert spent < len(whole) * 0.75, (spent, len(whole))


def test_a_prompt_held_to_its_end_is_tokenised_whole() -> None:
    tok = quiet(PromptTokenizer(bench(), cache_chars=1 << 22))
    text = mixed_text(random.Random(8), 6000)
    whole = np.asarray(tok.tok(text)["input_ids"], dtype=np.uint32)
    asked, held = held_up_to(1 << 30)
    before = tok.prefix.tokenized_tokens  # type: ignore[union-attr]
    got = asyncio.run(scan(tok, tok.plan(text, True), held, PIECE))  # type: ignore[arg-type]
    assert got.complete and got.n_tokens == len(whole)
    assert np.array_equal(got.tokens, whole)
    assert len(asked) >= 3  # it did go piece by piece
    # each character once plus each piece's look-ahead chunk: the last step tokenises
    # only what no piece covered (tokenising the scanned pieces again made it ~2.2x)
    spent = tok.prefix.tokenized_tokens - before  # type: ignore[union-attr]
    assert spent < 1.6 * len(whole), (spent, len(whole))
    # text the prompt token cache knows is not scanned: it costs nothing to tokenise
    asked, held = held_up_to(0)
    got = asyncio.run(scan(tok, tok.plan(text + " more", True), held, PIECE))  # type: ignore[arg-type]
    assert got.complete and asked == []
    # new text held nowhere: the first piece ends it
    other = mixed_text(random.Random(18), 6000)
    got = asyncio.run(scan(tok, tok.plan(other, True), held, PIECE))  # type: ignore[arg-type]
    assert not got.complete and asked == [len(got.tokens)]


def test_pieces_grow_from_a_small_first_one_so_a_scan_that_stops_at_once_costs_little(
        ) -> None:
    """Most scans stop at their first piece (the text past what the prompt token cache
    knows is new): that piece is small; a prefix held further takes pieces twice as long
    each time, up to the largest."""
    tok = quiet(PromptTokenizer(bench(), cache_chars=1 << 22))
    first, largest = 2048, 16384
    text = mixed_text(random.Random(13), 12000)  # ~50k characters held nowhere
    whole = len(tok.tok(text)["input_ids"])
    asked, held = held_up_to(0)
    before = tok.prefix.tokenized_tokens  # type: ignore[union-attr]
    got = asyncio.run(scan(tok, tok.plan(text, True), held, largest,  # type: ignore[arg-type]
                           first_chars=first))
    spent = tok.prefix.tokenized_tokens - before  # type: ignore[union-attr]
    assert not got.complete and asked == [len(got.tokens)]
    assert 0 < spent <= 1.5 * whole * first / len(text), (spent, whole)  # the first piece
    # held to its end: one lookup per piece, the pieces 2k, 4k, 8k, then 16k characters
    other = mixed_text(random.Random(14), 12000)
    asked, held = held_up_to(1 << 30)
    got = asyncio.run(scan(tok, tok.plan(other, True), held, largest,  # type: ignore[arg-type]
                           first_chars=first))
    cuts, step, cut = 0, first, first
    while cut < len(other):
        cuts += 1
        step = min(2 * step, largest)
        cut += step
    assert got.complete and len(asked) == cuts and asked == sorted(asked)
    assert np.array_equal(got.tokens, np.asarray(tok.tok(other)["input_ids"], dtype=np.uint32))

def test_without_the_prompt_text_cache_every_prompt_is_tokenised_whole() -> None:
    tok = PromptTokenizer(bench())  # cache_chars 0: pieces cannot be joined exactly
    assert not tok.scans
    text = mixed_text(random.Random(9), 6000)
    asked, held = held_up_to(0)
    got = asyncio.run(scan(tok, tok.plan(text, True), held, PIECE))  # type: ignore[arg-type]
    assert got.complete and asked == []
    assert np.array_equal(got.tokens, np.asarray(tok.tok(text)["input_ids"], dtype=np.uint32))


def test_a_sampled_check_replaces_a_wrong_prefix_and_turns_the_cache_off() -> None:
    tok = PromptTokenizer(bench(), cache_chars=1 << 22)
    text = mixed_text(random.Random(10), 6000)
    whole = np.asarray(tok.tok(text)["input_ids"], dtype=np.uint32)
    assert tok.check_prefix(text, True, whole[:100]) is None  # right: nothing to replace
    wrong = whole[:100].copy()
    wrong[50] += 1
    got = tok.check_prefix(text, True, wrong)
    assert got is not None and np.array_equal(got, whole)
    assert not tok.scans  # off for good: later prompts are tokenised whole
    # the scan's own check (the first results are checked): a stopped scan is exact
    tok = PromptTokenizer(bench(), cache_chars=1 << 22)
    asked, held = held_up_to(len(whole) // 2)
    got2 = asyncio.run(scan(tok, tok.plan(text, True), held, PIECE))  # type: ignore[arg-type]
    assert np.array_equal(got2.tokens, whole[:len(got2.tokens)]) and tok.scans


@pytest.mark.parametrize("kind", ["bench", "llama3", "metaspace"])
def test_the_token_bound_is_never_below_the_count(tmp_path: Path, kind: str) -> None:
    """What lets the router skip tokenising a prompt it can still refuse: the bound holds
    for emoji, CJK, decomposed accents and characters NFKC expands (one character, up to
    18 after normalising)."""
    path = bench() if kind == "bench" else trained(tmp_path, kind)
    tok = PromptTokenizer(path, cache_chars=1 << 22)
    rnd = random.Random(11)
    odd = ["\ufdfa", "\ufb01", "\u3392", "e\u0301", "😀", "中", " ", "\n", "a", "<s>"]
    texts = [mixed_text(rnd, 500), "".join(rnd.choice(odd) for _ in range(2000)),
             "\ufdfa" * 300, " " * 1000, "x"]
    assert len(unicodedata.normalize("NFKC", "\ufdfa")) == 18
    for text in texts:
        for special in (True, False):
            n = len(tok.tok(text, add_special_tokens=special)["input_ids"])
            assert tok.token_bound(text, special) >= n, (text[:20], special)


def test_a_shared_prefix_cut_by_a_scan_grows_with_a_request_that_holds_more() -> None:
    """The first requests of a new prefix stop at its first block (held nowhere yet): the
    shared prefix they leave must not cap what replication later warms."""
    bs = 4
    h = [bytes([i]) * 8 for i in range(10)]
    toks = np.arange(40, dtype=np.uint32)
    hp = HotPrefixes()
    hp.observe(h[:2], toks[:8], None, bs, cut=True)
    hp.observe(h[:8], toks[:32], None, bs, cut=True)  # held further now: it grows
    p = hp.get(h[0])
    assert p is not None and p.hashes == h[:8] and len(p.tokens) == 32 and p.cut
    hp.observe(h[:3], toks[:12], None, bs, cut=True)  # stopped inside it: knows no less
    assert p.hashes == h[:8]
    hp.observe(h[:6], toks[:24], None, bs)  # a whole prompt that ends there: shared is 6
    assert p.hashes == h[:6] and not p.cut
    hp.observe(h[:9], toks[:36], None, bs, cut=True)  # no longer cut: it cannot grow
    assert p.hashes == h[:6] and p.requests == 5


# ---- through the router app (fake engines: tests/router/test_router_app.py) ----
def scanning(tiny_dir: str) -> PromptTokenizer:
    tok = quiet(PromptTokenizer(tiny_dir, cache_chars=1 << 22))
    assert tok.scans
    return tok


def counting(tok: PromptTokenizer) -> tuple[Any, list[int]]:
    """Fake engines (test_router_app.py's) that note the tokens ``tok`` had produced when
    each request reached them: what its path tokenised before the dispatch, whatever a
    background hashing does after."""
    from tests.router.test_router_app import Upstreams

    seen: list[int] = []

    class Counting(Upstreams):
        async def handler(self, request: httpx.Request) -> httpx.Response:
            if request.url.path.startswith("/v1/"):
                seen.append(tok.prefix.tokenized_tokens)  # type: ignore[union-attr]
            return await super().handler(request)

    return Counting(), seen


def test_a_long_prompt_is_routed_on_its_held_blocks_and_forwarded_untouched(
        tiny_dir: str) -> None:
    """A new long prompt is tokenised before its dispatch only as far as its first piece;
    the rest is hashed after the dispatch and counted resident where it went, so a
    second request sharing it, sent while the first's prefill still runs (before any KV
    event), scans through all of it and follows. Each character is tokenised about once."""
    from tests.router.test_router_app import TWO, Upstreams, make_cfg, run

    tok = scanning(tiny_dir)
    doc = mixed_text(random.Random(12), 16000)  # ~65k characters held nowhere yet
    first, second = doc + " question one", doc + " answer one question two"
    whole = len(tok.tok(first)["input_ids"])
    ups, seen = counting(tok)
    limits = {"max_model_len": 1 << 20}

    async def fn(c: httpx.AsyncClient) -> list[str]:
        state = c._transport.app.state.router  # type: ignore[attr-defined]
        hosts = []
        for prompt in (first, second):
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                      "max_tokens": 2})
            assert r.status_code == 200, r.text
            hosts.append(r.headers["x-kvc-prefill"])
            # the hashing of the rest ends without any event from the engine
            await asyncio.gather(*state.proxy._beyond)
            if prompt is first:
                conductor = state.conductor
                hashes = conductor.hashes(tok.encode(first))
                inst = conductor.registry.get(hosts[0])
                run_ = conductor.index.match(hashes, 1 << inst.slot)[inst.slot]
                assert run_ == len(hashes) > 100  # all of it, not the first piece's
        return hosts

    hosts = run(make_cfg(tiny_dir, TWO, limits=limits), tok, ups, fn)
    assert [b["prompt"] for _, _, b in ups.calls] == [first, second]  # untouched
    assert hosts[0] == hosts[1]
    # before its dispatch the first request tokenised one piece or so, never the whole
    assert seen[0] < whole / 2, (seen, whole)
    # the first's rest once, the second's new words: no prompt tokenised twice over
    assert tok.prefix.tokenized_tokens < whole * 1.2, (  # type: ignore[union-attr]
        tok.prefix.tokenized_tokens, whole)

    # scan_prompts: false tokenises every prompt whole
    tok = scanning(tiny_dir)

    async def whole_fn(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": first,
                                                  "max_tokens": 2})
        assert r.status_code == 200
        assert tok.prefix.tokenized_tokens >= whole - 1  # type: ignore[union-attr]

    run(make_cfg(tiny_dir, TWO, limits=limits, cache={"scan_prompts": False}), tok,
        Upstreams(), whole_fn)


def test_a_flood_of_stopped_scans_hashes_a_bounded_number_of_rests_at_once(
        tiny_dir: str) -> None:
    """Hashing a stopped scan's rest runs beside the request; a flood of long new prompts
    starts at most ``BEYOND_MAX`` of them at once and drops the others (a routing hint
    the engines' KV events bring later), so it cannot queue unbounded tokenising."""
    from kvcentric.router.api import proxy as proxy_mod
    from kvcentric.router.conductor import Conductor
    from kvcentric.router.config import RouterConfig
    from kvcentric.router.cost.cost_model import Profile
    from kvcentric.router.fleet.instance_spec import InstanceSpec
    from kvcentric.router.fleet.store_view import StoreView
    from kvcentric.router.ops.metrics import RouterMetrics

    cfg = RouterConfig.from_dict({"model": "tiny", "tokenizer": tiny_dir,
                                  "keys": {"block_size": 16}})
    c = Conductor(cfg, Profile(b=1e-4, c=0.01), 1024, StoreView(None, "tiny"))
    c.registry.add(InstanceSpec(url="http://a:1", name="a"))
    full = c.hashes(np.arange(16 * 8, dtype=np.uint32))
    d = c.decide_local(full[:1], 16 * 8, 0)
    assert not isinstance(d, Rejection)
    started: list[int] = []

    async def go() -> None:
        gate = asyncio.Event()
        async with httpx.AsyncClient() as client:
            p = proxy_mod.Proxy(c, client, RouterMetrics(c))

            def rest_of(i: int) -> Any:
                async def rest() -> list[bytes]:
                    started.append(i)
                    await gate.wait()
                    return full
                return rest

            for i in range(proxy_mod.BEYOND_MAX + 5):
                p._resident_beyond_scan(d, f"r{i}", rest_of(i))
            assert len(p._beyond) == proxy_mod.BEYOND_MAX
            gate.set()
            await asyncio.gather(*p._beyond)
            assert not p._beyond

    asyncio.run(go())
    assert started == list(range(proxy_mod.BEYOND_MAX))
    assert c.index.match(full, 1 << d.prefill.slot)[d.prefill.slot] == len(full)


def test_a_prompt_that_may_be_too_long_is_counted_exactly_before_it_is_forwarded(
        tiny_dir: str) -> None:
    """The refusal of a prompt over the context needs its exact count: a prompt whose
    bound is over the limit and whose estimate is over half of it is tokenised whole,
    refused when it is over and served when the bound was loose; one estimated under
    half the limit is scanned like any other."""
    from tests.router.test_router_app import TWO, Upstreams, make_cfg, run

    tok = scanning(tiny_dir)
    rnd = random.Random(13)
    over = mixed_text(rnd, 9000)  # ~37k characters
    n = len(tok.tok(over)["input_ids"])
    assert tok.token_bound(over, True) > n + 1000  # a loose bound for this text
    ups = Upstreams()

    async def fn(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": over,
                                                  "max_tokens": 2})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert f"contains {n} input tokens" in r.json()["error"]["message"]

    run(make_cfg(tiny_dir, TWO, limits={"max_model_len": n}), tok, ups, fn)
    assert ups.calls == []

    async def fits(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": over,
                                                  "max_tokens": 2, "min_tokens": 1})
        assert r.status_code == 200, r.text

    run(make_cfg(tiny_dir, TWO, limits={"max_model_len": n + 2}), tok, Upstreams(), fits)

    tok = quiet(PromptTokenizer(bench(), cache_chars=1 << 22))  # ~6 characters a token
    # words the tokenizer has whole (as the benchmarks' prompts): a space and 6+ letters
    words = sorted(w[1:] for w in tok.tok.get_vocab()
                   if w.startswith("\u0120") and len(w) > 6 and w[1:].isalpha())
    over = "".join(" " + rnd.choice(words) for _ in range(6000))
    n = len(tok.tok(over)["input_ids"])
    loose = {"max_model_len": int(n * 2.5)}
    assert tok.token_bound(over, True) > loose["max_model_len"]  # the bound cannot tell

    ups, seen = counting(tok)

    async def estimated(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": over,
                                                  "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert seen[0] < n / 2  # before its dispatch (its rest is hashed after)
        # a min_tokens only the exact count can check: tokenised whole
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": over + " x",
                                                  "max_tokens": 4, "min_tokens": 2})
        assert r.status_code == 200, r.text
        assert tok.prefix.tokenized_tokens > n  # type: ignore[union-attr]

    run(make_cfg(tiny_dir, TWO, limits=loose), tok, ups, estimated)
