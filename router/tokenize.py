"""In-process tokenisation with the model's own tokenizer and chat template.

Mirrors what vLLM's OpenAI server does so the router hashes the very tokens the engine
will see: completions tokenise the prompt with special tokens (unless the request says
``add_special_tokens: false``); chat renders the template to text, then tokenises it
without special tokens. A mismatch here would only cost routing quality, never output
correctness: the engine tokenises the untouched request itself.

Token ids come back as a 1-D ``uint32`` numpy array (what :func:`block_hashes` hashes).
With ``cache_chars`` > 0 a prompt that starts with text seen before is tokenised only from
near the end of that prefix (:mod:`kvcentric.router.prefix_tokens`), if probe texts show
that gives this tokenizer's own ids; a sample of results is checked against a whole
tokenisation and any mismatch turns that off for good.
Rendering takes only the ``chat_template_kwargs`` keys it is told to allow
(:mod:`kvcentric.router.chat_template`): a key that could replace the template never reaches
``apply_chat_template``.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvcentric.router import chat_template
from kvcentric.router.prefix_tokens import Encoded, PrefixTokens, Reuse

log = logging.getLogger(__name__)

# a prompt with at most this many characters left to tokenise (past a known prefix) is
# tokenised on the event loop: a worker thread's hand-off costs more router CPU than
# tokenising that much, and the loop stalls well under a millisecond for it
INLINE_CHARS = 3072


@dataclass(frozen=True)
class Plan:
    """One prompt's tokenisation, as :meth:`PromptTokenizer.plan` decided it."""

    text: str
    add_special_tokens: bool
    reuse: Reuse | None   # the prompt token cache's known prefix (None: no cache)
    verify: bool          # a whole tokenisation checks the cached result

    @property
    def inline(self) -> bool:
        """Cheap enough for the event loop: few characters to tokenise, no check."""
        left = len(self.text) - (self.reuse.start if self.reuse is not None else 0)
        return not self.verify and left <= INLINE_CHARS


# tokenizer classes that are transformers' generic fast tokenizer itself: loading it
# directly gives what AutoTokenizer would, without importing every model's code (AutoTokenizer
# pulls in torch: ~3 s and ~340 MB more per router process, and a restarted replica's
# time before it routes)
GENERIC_FAST = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def _load(model_dir: Path) -> Any:
    """The model folder's tokenizer, as ``AutoTokenizer.from_pretrained`` loads it."""
    try:
        cls = json.loads((model_dir / "tokenizer_config.json").read_text()).get(
            "tokenizer_class")
    except (OSError, ValueError, AttributeError):
        cls = None
    if cls in GENERIC_FAST and (model_dir / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


class PromptTokenizer:
    """The tokenizer of the model in ``model_dir`` (``tokenizer.json`` and friends)."""

    def __init__(self, model_dir: str | Path, cache_chars: int = 0) -> None:
        if not Path(model_dir).is_dir():  # else transformers would take it for a hub id
            raise ValueError(f"tokenizer {str(model_dir)!r} is not a local folder (relative "
                             "to the working directory): give the model folder, never a "
                             "hub id")
        try:
            self.tok = _load(Path(model_dir))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load a tokenizer from {model_dir}: {exc}") from exc
        # the router never truncates; the engine enforces its own max_model_len
        self.tok.model_max_length = 1 << 62
        self._rust = self._released_gil_encoder()
        self.reserved = chat_template.reserved_for(self.tok)
        self.template_variables = chat_template.template_variables(
            getattr(self.tok, "chat_template", None))
        # vLLM's bound on the characters of a prompt of n tokens: n times the longest token
        self.max_chars_per_token = max((len(t) for t in self.tok.get_vocab()), default=1)
        self._counted = threading.Lock()
        self._tokenized = 0
        self.prefix = self._prefix_cache(cache_chars) if cache_chars else None
        self._tokenized = 0  # the prompt token cache's probes are not prompts

    def template_kwargs(self, allow_list: tuple[str, ...] | None) -> frozenset[str]:
        """The ``chat_template_kwargs`` keys a request may set (``allow_list``: the
        operator's, else the template's own variables)."""
        return chat_template.allowed_kwargs(self.template_variables, allow_list,
                                            self.reserved)

    @property
    def vocab_size(self) -> int:
        """Token ids this tokenizer knows (a prompt of ids must stay below it)."""
        return len(self.tok)

    def plan(self, text: str, add_special_tokens: bool = True) -> Plan:
        """How :meth:`run` will tokenise ``text``: from which known prefix, whether a whole
        tokenisation checks the result, and so whether it is cheap enough to run on the
        caller's thread (:attr:`Plan.inline`)."""
        p = self.prefix
        if p is None or not p.enabled:
            return Plan(text, add_special_tokens, None, False)
        return Plan(text, add_special_tokens, p.lookup(text, add_special_tokens),
                    p.should_verify())

    def replan(self, plan: Plan) -> Plan:
        """``plan`` with the prompt token cache looked up again (its check kept): after a
        scan's pieces added their anchors, only the text past them is left to tokenise,
        not all the scan already did."""
        p = self.prefix
        if p is None or plan.reuse is None or not p.enabled:
            return plan
        return replace(plan, reuse=p.lookup(plan.text, plan.add_special_tokens, plan.reuse))

    def run(self, plan: Plan) -> np.ndarray:
        """Token ids of ``plan.text``. Off the event loop unless ``plan.inline``: the Rust
        tokenizer's batch call releases the GIL, its single call and transformers' wrapper
        hold it (~5 ms for 8k tokens, a stall of the loop)."""
        p, text, special = self.prefix, plan.text, plan.add_special_tokens
        if p is None or plan.reuse is None or not p.enabled:
            return self._whole(text, special)
        ids = p.encode(text, special, plan.reuse)
        if plan.verify:
            whole = self._whole(text, special)
            if not np.array_equal(whole, ids):
                log.warning("prompt token cache disagreed with a whole tokenisation "
                            "(%d vs %d tokens): turned off", len(ids), len(whole))
                p.disable()
                return whole
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """Token ids of ``text``: :meth:`run` of :meth:`plan` (``[n]`` uint32)."""
        return self.run(self.plan(text, add_special_tokens))

    @property
    def scans(self) -> bool:
        """Whether a prompt can be tokenised piece by piece (:meth:`known_prefix`): the
        prompt token cache is on, so pieces join exactly where a whole tokenisation
        would put the same ids."""
        return self.prefix is not None and self.prefix.enabled and self._rust is not None

    def token_bound(self, text: str, add_special_tokens: bool) -> int:
        """At most how many tokens ``text`` makes, without tokenising it: its normalised
        UTF-8 bytes (every token of a byte-level, byte-fallback, WordPiece or Unigram
        model covers at least one), one for a prefix space, and the special tokens."""
        norm = self._rust.normalizer if self._rust is not None else None
        n = len((norm.normalize_str(text) if norm is not None else text).encode("utf-8"))
        return n + 1 + (self.tok.num_special_tokens_to_add() if add_special_tokens else 0)

    def known_prefix(self, text: str, add_special_tokens: bool, chars: int,
                     after: Reuse | None = None) -> tuple[np.ndarray, int]:
        """Token ids of a leading part of ``text`` that a whole tokenisation would begin
        with, and how many characters they cover, after tokenising at most ``text[:chars]``
        (only past what the prompt token cache already holds); requires :attr:`scans`.
        The ids end before the last pre-token boundary the cache can vouch for: the
        characters after the cut could still merge with those before it. ``after``: an
        earlier lookup of ``text`` (its plan's), whose walk the lookups here resume."""
        p = self.prefix
        assert p is not None
        if chars < len(text):
            piece = text[:chars]  # tokenised past what is known: adds the piece's anchors
            p.encode(piece, add_special_tokens, p.lookup(piece, add_special_tokens, after))
        reuse = p.lookup(text, add_special_tokens, after)
        if not reuse.chunks:
            return np.zeros(0, dtype=np.uint32), 0
        return np.concatenate([c.ids for c in reuse.chunks]), reuse.start

    def check_prefix(self, text: str, add_special_tokens: bool, ids: np.ndarray
                     ) -> np.ndarray | None:
        """Whole-tokenise ``text`` and check that it begins with ``ids`` (a sampled check
        of :meth:`known_prefix`): None when it does, else the whole ids, with the prompt
        token cache turned off for good."""
        whole = self._whole(text, add_special_tokens)
        if np.array_equal(whole[:len(ids)], ids):
            return None
        log.warning("prompt token cache disagreed with a whole tokenisation in its first "
                    "%d tokens: turned off", len(ids))
        assert self.prefix is not None
        self.prefix.disable()
        return whole

    @property
    def tokenized_tokens(self) -> int:
        """Token ids this tokenizer has produced for prompts since it was made: whole
        prompts, scan pieces and the prompt token cache's checks (what tokenising cost)."""
        return self._tokenized

    @property
    def reused_tokens(self) -> int:
        """Token ids taken from the prompt token cache instead of tokenised."""
        return self.prefix.reused_tokens if self.prefix is not None else 0

    def _count(self, n: int) -> None:
        with self._counted:  # tokenising runs on several worker threads
            self._tokenized += n

    def _whole(self, text: str, add_special_tokens: bool) -> np.ndarray:
        if self._rust is not None:
            enc = self._rust.encode_batch([text], add_special_tokens=add_special_tokens)
            out = np.asarray(enc[0].ids, dtype=np.uint32)
        else:
            ids = self.tok(text, add_special_tokens=add_special_tokens)["input_ids"]
            out = np.asarray(ids, dtype=np.uint32)
        self._count(len(out))
        return out

    def _encoding(self, text: str, add_special_tokens: bool) -> Encoded:
        e = self._rust.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        self._count(len(e.ids))
        return e.ids, e.word_ids, e.offsets

    def _prefix_cache(self, max_chars: int) -> PrefixTokens | None:
        """A :class:`PrefixTokens` over this tokenizer if, on probe texts cut into chunks
        of 8 characters (hundreds of anchors), it gives the ids of a whole tokenisation
        for every text, with and without special tokens; else None (logged)."""
        if self._rust is None:
            return None
        probe = PrefixTokens(self._encoding, 1 << 20, anchor_chars=8)
        rnd = random.Random(0)
        pieces = ["Hello", " world", "  two", "\n\n", " \t", "'s", "'ll", " 12345", "6",
                  " ünïcödé", "你好", "。", " <|x|>", "!!", " a", "   ", "\r\n", "x"]
        base = "".join(rnd.choice(pieces) for _ in range(400))
        texts = [base, base + " and more", base[:700] + "Z" + base[700:],
                 base[:333], base[:333] + " " + base[:200], base + "\n", base + "6"]
        for special in (True, False):
            for t in texts:
                if not np.array_equal(np.asarray(self._encoding(t, special)[0]),
                                      probe.encode(t, special)):
                    log.info("prompt token cache off: this tokenizer's ids depend on "
                             "more than the text before a pre-token boundary")
                    return None
        return PrefixTokens(self._encoding, max_chars)

    def _released_gil_encoder(self) -> Any:
        """The fast tokenizer's ``tokenizers.Tokenizer`` when calling it directly gives
        transformers' own ids (checked on a probe text, with and without special tokens),
        else None (slow tokenizers, or a wrapper that adds tokens of its own)."""
        from transformers import PreTrainedTokenizerFast

        if not isinstance(self.tok, PreTrainedTokenizerFast):
            return None
        rust = self.tok.backend_tokenizer
        probe = "Hello, world! 12 tokens\n\tand some ünïcödé; 你好. <|x|> end"
        for special in (True, False):
            want = self.tok(probe, add_special_tokens=special)["input_ids"]
            if rust.encode_batch([probe], add_special_tokens=special)[0].ids != want:
                return None
        return rust

    def completion_ids(self, body: Mapping[str, Any]) -> np.ndarray:
        """Token ids of a ``/v1/completions`` body's (first) prompt; ``ValueError`` if the
        prompt is missing or malformed."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch goes to one instance: route by its first prompt
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return self.encode(prompt, bool(body.get("add_special_tokens", True)))
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32
                for t in prompt):
            return np.asarray(prompt, dtype=np.uint32)
        raise ValueError("prompt must be a non-empty string, list of token ids, or a list "
                         "of those")

    def chat_text(self, body: Mapping[str, Any],
                  allowed: frozenset[str] | None = None) -> str:
        """A ``/v1/chat/completions`` body rendered with the model's chat template;
        ``ValueError`` for malformed messages, a ``chat_template_kwargs`` key outside
        ``allowed`` (default: :meth:`template_kwargs` without an allow-list) or a template
        error."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        norm = [_message(m) for m in messages]
        kwargs = dict(body.get("chat_template_kwargs") or {})
        allowed = self.template_kwargs(None) if allowed is None else allowed
        refused = sorted(set(kwargs) - allowed)
        if refused:
            raise ValueError(f"chat_template_kwargs may not set {refused}: only the "
                             f"variables of the model's chat template ({sorted(allowed)})")
        try:
            text = self.tok.apply_chat_template(
                norm, tokenize=False,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                **kwargs)
        except Exception as exc:  # jinja errors of every kind are the request's fault
            raise ValueError(f"the chat template cannot render these messages: {exc}") from exc
        return str(text)

    def chat_ids(self, body: Mapping[str, Any]) -> np.ndarray:
        """Token ids of a ``/v1/chat/completions`` body rendered with the chat template
        (special tokens added on top only with ``add_special_tokens: true``, as vLLM)."""
        return self.encode(self.chat_text(body), bool(body.get("add_special_tokens", False)))


def _message(m: Any) -> dict[str, Any]:
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
        raise ValueError("each message must be an object with a string 'role'")
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        texts = []
        for part in content:
            if not isinstance(part, Mapping):
                raise ValueError("message content parts must be objects")
            if part.get("type") == "text":
                texts.append(str(part.get("text", "")))
        content = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise ValueError("message content must be a string or a list of parts")
    return {**m, "content": content or ""}
