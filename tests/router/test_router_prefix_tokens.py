"""The router's prompt token cache gives the tokenizer's own ids, or stays off.

Real tokenizers, loaded from disk as the router loads them: the bench model's byte-level
BPE, and small ones trained here with the pre-tokenizers real models use (a Llama-3-style
split regex, SentencePiece's ``Metaspace``) and two whose ids depend on where the text
starts or ends (a stripping normalizer, a post-processor that appends an end token).
"""

from __future__ import annotations

import itertools
import json
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcentric.router import prefix_tokens, tokenize
from kvcentric.router.config import CacheConfig
from kvcentric.router.prefix_tokens import PrefixTokens, Reuse
from kvcentric.router.tokenize import PromptTokenizer
from kvcentric.testing.models import build_model

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def bench() -> Path:
    return build_model("bench", Path.cwd() / ".models" / "bench")  # cached, as conftest's


def mixed_text(rnd: random.Random, n: int) -> str:
    pieces = ["the", " cat", "  sat", "\n\n", " \t", "'s", "'re", " 2024", "7", " naïve",
              "中文", "。", " {x}", "!!", " a", "    ", "\r\n", "Zz", " -- ", "😀"]
    return "".join(rnd.choice(pieces) for _ in range(n))


def texts_sharing_prefixes(seed: int) -> list[str]:
    """Prompts as a fleet sends them: long shared prefixes (documents, system prompts,
    histories) followed by their own text, cut anywhere (mid-word, mid-whitespace run)."""
    rnd = random.Random(seed)
    docs = [mixed_text(rnd, 1500) for _ in range(3)]
    out = []
    for i in range(60):
        doc = docs[i % 3]
        cut = rnd.randrange(len(doc)) if i % 4 == 0 else len(doc)
        out.append(doc[:cut] + mixed_text(rnd, rnd.randrange(0, 200)))
    out += [docs[0] + docs[1], docs[0] + " " + docs[1], docs[0] + "\n", docs[0] * 2]
    return out


def trained(tmp: Path, kind: str) -> Path:
    """A BPE tokenizer trained here with ``kind``'s pre-tokenizer/post-processor,
    written as a model folder (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    if kind == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
    else:
        if kind == "strip":
            tok.normalizer = normalizers.Strip()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    rnd = random.Random(0)
    tok.train_from_iterator((mixed_text(rnd, 60) for _ in range(400)), trainer=trainer)
    single = "<s> $A </s>" if kind == "eos" else "<s> $A"
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[("<s>", 0), ("</s>", 1)])
    out = tmp / kind
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
        "eos_token": "</s>"}))
    return out


def assert_exact(tok: PromptTokenizer, texts: list[str]) -> None:
    for text, special in itertools.product(texts, (True, False)):
        want = np.asarray(tok.tok(text, add_special_tokens=special)["input_ids"],
                          dtype=np.uint32)
        got = tok.encode(text, special)
        assert got.dtype == np.uint32 and np.array_equal(got, want), (text[:60], special)


def test_prefixes_seen_before_are_reused_and_ids_stay_exact() -> None:
    tok = PromptTokenizer(bench(), cache_chars=1 << 22)
    assert tok.prefix is not None
    tok.prefix._verify_first = 0  # no whole-tokenisation checks: the ids alone must match
    tok.prefix._verify_every = 1 << 30
    texts = texts_sharing_prefixes(1)
    assert_exact(tok, texts)
    p = tok.prefix
    assert p.enabled
    # most of the tokens came from the cache, not the tokenizer
    assert p.reused_tokens > p.tokenized_tokens, (p.reused_tokens, p.tokenized_tokens)


@pytest.mark.parametrize("kind", ["llama3", "metaspace"])
def test_split_regex_and_sentencepiece_style_are_cached_and_exact(tmp_path: Path,
                                                                   kind: str) -> None:
    """Metaspace prepends '▁' only to a text that does not start with one: its
    pre-tokens start at spaces, so a tail cut there gets nothing prepended."""
    tok = PromptTokenizer(trained(tmp_path, kind), cache_chars=1 << 22)
    assert tok.prefix is not None
    assert_exact(tok, texts_sharing_prefixes(2))
    assert tok.prefix.enabled and tok.prefix.reused_tokens > 0


@pytest.mark.parametrize("kind", ["strip", "eos"])
def test_tokenizers_whose_ids_depend_on_the_text_start_or_end_get_no_cache(
        tmp_path: Path, kind: str) -> None:
    """A normalizer that strips the text's leading spaces would strip a tail's too; an
    appended end token lands after any tail: a reused prefix would give other ids."""
    tok = PromptTokenizer(trained(tmp_path, kind), cache_chars=1 << 22)
    assert tok.prefix is None
    assert_exact(tok, texts_sharing_prefixes(3)[:10])


def test_a_wrong_cached_id_is_caught_by_the_check_and_turns_the_cache_off() -> None:
    tok = PromptTokenizer(bench(), cache_chars=1 << 22)
    assert tok.prefix is not None
    texts = texts_sharing_prefixes(4)
    for t in texts[:20]:
        tok.encode(t)
    # corrupt every cached chunk: what a tokenizer the probes did not catch would do
    for chunks in tok.prefix._chunks.values():
        for c in chunks:
            c.ids[0] ^= 1
    tok.prefix._verify_first = 0
    tok.prefix._verify_every = 1  # the check runs on this one
    want = np.asarray(tok.tok(texts[3])["input_ids"], dtype=np.uint32)
    assert np.array_equal(tok.encode(texts[3]), want)
    assert not tok.prefix.enabled and tok.prefix.chars == 0
    assert_exact(tok, texts[20:30])  # whole tokenisation from then on


def test_memory_is_bounded_oldest_prefixes_first() -> None:
    tok = PromptTokenizer(bench(), cache_chars=1)
    assert tok.prefix is not None
    p = PrefixTokens(tok._encoding, max_chars=20_000, anchor_chars=256)
    rnd = random.Random(5)
    docs = [mixed_text(rnd, 2000) for _ in range(12)]
    for d in docs:
        assert np.array_equal(p.encode(d, True), tok._whole(d, True))
        assert p.chars <= 20_000
    p.tokenized_tokens = 0
    p.encode(docs[-1] + "x", True)  # the newest document is still there
    assert p.tokenized_tokens < len(tok._whole(docs[-1], True)) / 4
    p.tokenized_tokens = 0
    p.encode(docs[0] + "x", True)  # the oldest was dropped: tokenised whole
    assert p.tokenized_tokens == len(tok._whole(docs[0] + "x", False)) + 1


def test_config_turns_it_off_and_refuses_negative_sizes() -> None:
    assert PromptTokenizer(bench(), cache_chars=0).prefix is None
    with pytest.raises(ValueError, match="prompt_text_chars"):
        CacheConfig(prompt_text_chars=-1)


def test_the_event_loop_tokenises_only_a_little_past_a_known_prefix() -> None:
    """:attr:`Plan.inline`: a long prompt seen before (its new tail short) and a short
    prompt are tokenised on the loop; a long new one, and any one a whole tokenisation
    checks, go to a worker thread. Either way the ids are the tokenizer's own."""
    tok = PromptTokenizer(bench(), cache_chars=1 << 22)
    assert tok.prefix is not None
    rnd = random.Random(6)
    doc = mixed_text(rnd, 6000)
    assert len(doc) > 4 * tokenize.INLINE_CHARS
    tok.prefix._verify_first = 0
    tok.prefix._verify_every = 1 << 30
    first = tok.plan(doc + " first question")
    assert not first.inline and first.reuse is not None and first.reuse.start == 0
    assert_exact(tok, [doc + " first question"])
    again = tok.plan(doc + " another question")
    assert again.inline and again.reuse is not None
    assert len(again.text) - again.reuse.start <= tokenize.INLINE_CHARS
    short = tok.plan("a short prompt")
    assert short.inline
    for plan in (again, short):
        want = np.asarray(tok.tok(plan.text)["input_ids"], dtype=np.uint32)
        assert np.array_equal(tok.run(plan), want)
    tok.prefix._verify_every = 1  # the next result is checked: never on the loop
    assert not tok.plan(doc + " a third question").inline
    assert not PromptTokenizer(bench(), cache_chars=0).plan(doc).inline


def test_a_prompt_extending_a_known_one_retokenises_little_of_what_they_share() -> None:
    """A conversation's next turn or a system prompt with a new question: past the last
    reused anchor the default cache re-tokenises a partial chunk and one chunk of
    look-ahead, a few hundred characters of an 8k-token prompt, not thousands."""
    tok = PromptTokenizer(bench(), cache_chars=1 << 20)
    assert tok.prefix is not None
    rnd = random.Random(11)
    shared = mixed_text(rnd, 6000)
    for _ in range(3):
        question = mixed_text(rnd, 40)
        tok.prefix.tokenized_tokens = 0
        ids = tok.encode(shared + question)
        assert np.array_equal(ids, tok._whole(shared + question, True))
    new = len(tok._whole(question, False))
    assert tok.prefix.tokenized_tokens - new <= len(tok._whole(shared[-600:], False))


def test_a_lookup_resumed_from_an_earlier_walk_finds_what_a_fresh_one_does() -> None:
    """A scanned prompt is looked up several times (its plan, each piece, the rest):
    resuming the plan's walk gives the same reuse as walking from the start, for the
    prompt itself, a piece of it, after the pieces added anchors, and after the chunks
    it walked were evicted (their ids are still the prompt's)."""
    tok = PromptTokenizer(bench(), cache_chars=1 << 20)
    p = tok.prefix
    assert p is not None
    rnd = random.Random(5)
    shared = mixed_text(rnd, 3000)
    p.encode(shared + mixed_text(rnd, 30), True)  # the shared prefix is known
    text = shared + mixed_text(rnd, 400)
    plan = p.lookup(text, True)
    assert plan.chunks and len(plan.path) == len(plan.chunks) + 1

    def same(got: Reuse, want: Reuse) -> None:
        assert (got.start, [c.node for c in got.chunks]) == (want.start,
                                                              [c.node for c in want.chunks])

    same(p.lookup(text, True, plan), p.lookup(text, True))
    piece = text[:len(shared) // 2]
    same(p.lookup(piece, True, plan), p.lookup(piece, True))
    p.encode(text[:len(shared) + 800], True)  # a scan piece adds anchors past the prefix
    resumed = p.lookup(text, True, plan)
    same(resumed, p.lookup(text, True))
    assert resumed.start > plan.start
    ids = p.encode(text, True, resumed)
    assert np.array_equal(ids, tok._whole(text, True))
    p._chunks.clear()  # every chunk evicted: the resumed walk keeps what it knew
    kept = p.lookup(text, True, resumed)
    assert kept.start == resumed.start
    assert np.array_equal(p.encode(text, True, kept), tok._whole(text, True))


class _CountedGets(OrderedDict):  # type: ignore[type-arg]
    """The chunk map, counting the key lookups a walk makes (one per step)."""

    gets = 0

    def get(self, key: Any, default: Any = None) -> Any:
        self.gets += 1
        return super().get(key, default)


def _conversation(seed: int, turns: int) -> list[str]:
    """A conversation's prompts: each the last one plus an answer and a new question,
    long enough that the known prefix is several express links."""
    rnd = random.Random(seed)
    text = mixed_text(rnd, 12 * prefix_tokens.EXPRESS_CHUNKS * 40)
    out = []
    for _ in range(turns):
        text += mixed_text(rnd, rnd.randrange(50, 400))
        out.append(text)
    return out


def test_a_walk_rides_express_links_and_finds_what_a_step_by_step_walk_does() -> None:
    """Two caches fed the same prompts, one laying express links and one never: every
    lookup (whole prompts, prompts cut inside a link, prompts that leave the chain inside
    one, resumed lookups) finds the same chunks, the ids stay the tokenizer's, and a
    prompt seen before is walked in a step per link, not per chunk."""
    tok = PromptTokenizer(bench(), cache_chars=1)
    fast = PrefixTokens(tok._encoding, max_chars=1 << 24)
    slow = PrefixTokens(tok._encoding, max_chars=1 << 24, express_chunks=0)
    rnd = random.Random(7)
    texts = _conversation(1, 6)
    texts += [t[:rnd.randrange(len(t))] for t in texts]  # cut anywhere, inside links too
    texts += [t[:len(t) // 2] + "😀 off the chain" + t[len(t) // 2:] for t in texts[:3]]

    def walked(p: PrefixTokens, text: str) -> tuple[int, list[int]]:
        r = p.lookup(text, False)
        return r.start, [c.node for c in r.chunks]

    for text in texts:
        want = walked(slow, text)
        assert walked(fast, text) == want
        resumed = fast.lookup(text[:len(text) // 3], False)
        assert fast.lookup(text, False, resumed).start == want[0]
        ids = fast.encode(text, False)
        assert np.array_equal(slow.encode(text, False), ids)
        assert np.array_equal(ids, tok._whole(text, False))
    assert fast._express and not slow._express

    fast._chunks = counted = _CountedGets(fast._chunks)
    reuse = fast.lookup(texts[5], False)
    assert len(reuse.chunks) > 4 * prefix_tokens.EXPRESS_CHUNKS
    assert counted.gets <= 2 * prefix_tokens.EXPRESS_CHUNKS, counted.gets


def test_an_express_link_through_an_evicted_chunk_is_dropped_and_not_ridden() -> None:
    """A chunk evicted from the middle of a known chain: the walk stops where a step by
    step walk would (before it) and the link over it is gone; the ids stay exact."""
    tok = PromptTokenizer(bench(), cache_chars=1)
    p = PrefixTokens(tok._encoding, max_chars=1 << 24)
    text = _conversation(2, 1)[0]
    p.encode(text, False)
    first = p.lookup(text, False)  # lays the links
    assert len(first.chunks) > 3 * prefix_tokens.EXPRESS_CHUNKS
    victim = first.path[prefix_tokens.EXPRESS_CHUNKS + 5]
    links = [n for n, link in p._express.items() if victim in link.chunks]
    assert links
    p._chunks.pop(victim.key)  # what eviction does to the least recently used
    p._live.discard(victim.node)
    again = p.lookup(text, False)
    before = first.path.index(victim)
    assert [c.node for c in again.path] == [c.node for c in first.path[:before]]
    assert not any(n in p._express for n in links)
    assert np.array_equal(p.encode(text, False, again), tok._whole(text, False))
