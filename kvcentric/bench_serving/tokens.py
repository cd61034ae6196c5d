"""Token-exact synthetic prompts from the served model's own tokenizer.

A *word* token is one whose text is a space followed by ASCII letters (``" wolf"``) and
that encodes back to itself. Any sequence of word tokens decodes to text that the same
tokenizer encodes back to exactly that sequence (each word is its own pre-token), so a
prompt sent as text is token-exact: the server sees the ids we built, after its BOS.

Not every tokenizer has word tokens (a word-level one has no leading spaces: ``"a" +
"b"`` is one unknown word, not two tokens). Then :attr:`TokenSource.text_exact` is False,
:attr:`TokenSource.text_problem` says why, and prompts are drawn from every non-special
token: they are exact only as token ids (``/v1/completions`` accepts those from any
tokenizer), never as text.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

TAG_DIGITS = 3  # leading tokens of a tagged block that spell its tag in base len(words)
MIN_WORDS = 64  # fewer distinct tokens than this cannot make varied prompts
_PROBE_LEN = 512


class TokenSource:
    """The tokenizer at ``path`` (``transformers.AutoTokenizer``) plus the tokens prompts
    are drawn from: its word tokens when they make token-exact text (``text_exact``),
    else every non-special token (token-id prompts only).

    Raises ``ValueError`` when the tokenizer has fewer than :data:`MIN_WORDS` usable tokens.
    """

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.path = path
        self.tok = AutoTokenizer.from_pretrained(path)
        self.text_problem: str | None = None
        try:
            self.words = self._find_words()
            self._check_round_trip()
        except ValueError as e:
            self.text_problem = str(e)
            self.words = self._plain_ids()

    @property
    def text_exact(self) -> bool:
        """Whether prompts can be sent as text that the server tokenises back exactly."""
        return self.text_problem is None

    def _find_words(self) -> list[int]:
        n = len(self.tok)
        texts = self.tok.batch_decode([[i] for i in range(n)], skip_special_tokens=True)
        pieces = self.tok.convert_ids_to_tokens(list(range(n)))
        out = []
        for i, (text, piece) in enumerate(zip(texts, pieces)):
            body = str(piece)[1:] if str(piece)[:1] in ("Ġ", "▁") else text[1:]
            if (text.startswith(" ") or str(piece)[:1] in ("Ġ", "▁")) and body.isascii() \
                    and body.isalpha() and len(body) >= 1:
                out.append(i)
        if len(out) < MIN_WORDS:
            raise ValueError(f"tokenizer {self.path} has {len(out)} word tokens (a space "
                             f"followed by letters); text prompts need at least {MIN_WORDS}")
        return out

    def _check_round_trip(self) -> None:
        rnd = random.Random(0)
        probe = [rnd.choice(self.words) for _ in range(_PROBE_LEN)]
        if self.encode(self.text(probe), special=False) != probe:
            # Keep only words that survive as singletons, then re-check the sequence.
            self.words = [w for w in self.words
                          if self.encode(self.text([w]), special=False) == [w]]
            probe = [rnd.choice(self.words) for _ in range(_PROBE_LEN)] if self.words else [0]
            if len(self.words) < MIN_WORDS \
                    or self.encode(self.text(probe), special=False) != probe:
                raise ValueError(f"tokenizer {self.path}: its word tokens do not survive "
                                 "decode -> encode, so no text is token-exact")

    def _plain_ids(self) -> list[int]:
        """Every token but the special ones (for token-id prompts)."""
        special = set(self.tok.all_special_ids)
        out = [i for i in range(len(self.tok)) if i not in special]
        if len(out) < MIN_WORDS:
            raise ValueError(f"tokenizer {self.path} has only {len(out)} non-special tokens; "
                             f"synthetic prompts need at least {MIN_WORDS}")
        return out

    # ---- text <-> ids ----
    def text(self, ids: Sequence[int]) -> str:
        """Decoded text of ``ids`` (no special tokens)."""
        return str(self.tok.decode(list(ids), skip_special_tokens=True,
                                   clean_up_tokenization_spaces=False))

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of ``text``; ``special`` adds what the server adds (e.g. BOS)."""
        return list(self.tok.encode(text, add_special_tokens=special))

    def chat_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Prompt ids the server builds for ``messages`` with the model's chat template."""
        out: Any = self.tok.apply_chat_template([dict(m) for m in messages], tokenize=True,
                                                add_generation_prompt=True)
        if isinstance(out, Mapping) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    # ---- synthesis ----
    def random_ids(self, rnd: random.Random, n: int) -> list[int]:
        """``n`` random tokens (word tokens where ``text_exact``) drawn with ``rnd``."""
        return [rnd.choice(self.words) for _ in range(n)]

    def tagged_block(self, tag: int, n: int, seed: int = 0) -> list[int]:
        """``n`` word tokens that are a pure function of ``(tag, seed, n)``.

        The first :data:`TAG_DIGITS` tokens spell ``tag`` (most significant first), so
        blocks of at least that length with different tags always differ; the rest is
        random, seeded by ``(seed, tag)``. Raises ``ValueError`` for a tag out of range.
        """
        base = len(self.words)
        if not 0 <= tag < base ** TAG_DIGITS:
            raise ValueError(f"tag {tag} out of range for {base} word tokens")
        digits = [(tag // base ** k) % base for k in reversed(range(TAG_DIGITS))]
        head = [self.words[d] for d in digits]
        rnd = random.Random(f"block/{seed}/{tag}")
        return (head + self.random_ids(rnd, max(0, n - TAG_DIGITS)))[:n]
