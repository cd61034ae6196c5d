"""The router's tokenizer gives transformers' own ids on every path it takes."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from kvcentric.router.tokenize import PromptTokenizer
from kvcentric.testing.models import build_model

TEXTS = ["", "a", "Hello, world!", "  leading and trailing  ", "tabs\tand\nnewlines\r\n",
         "ünïcödé 你好 🙂 mixed", "<|im_start|>user\nhi<|im_end|>"]


def random_text(seed: int, n: int) -> str:
    rnd = random.Random(seed)
    return "".join(chr(rnd.choice([rnd.randrange(32, 127), rnd.randrange(0xA0, 0x2FF),
                                   rnd.randrange(0x4E00, 0x4F00), 10, 32]))
                   for _ in range(n))


@pytest.mark.parametrize("name", ["tiny", "bench"])
def test_released_gil_path_matches_transformers(name: str) -> None:
    model = build_model(name, Path.cwd() / ".models" / name)  # cached, as conftest's
    tok = PromptTokenizer(model)
    assert tok._rust is not None  # the fast path is the one under test
    for text in [*TEXTS, *(random_text(s, 3000) for s in range(4))]:
        for special in (True, False):
            want = np.asarray(tok.tok(text, add_special_tokens=special)["input_ids"],
                              dtype=np.uint32)
            got = tok.encode(text, add_special_tokens=special)
            assert got.dtype == np.uint32 and np.array_equal(got, want), (text[:40], special)
