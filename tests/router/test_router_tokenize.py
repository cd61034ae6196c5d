"""The router's tokenizer gives transformers' own ids on every path it takes."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

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


def test_a_generic_fast_tokenizer_loads_without_autotokenizer_and_as_it_would(
        tmp_path: Path) -> None:
    """A folder whose tokenizer_config names transformers' generic fast tokenizer is
    loaded as that class directly (no model code imported); the ids and chat template
    are AutoTokenizer's. Another class name goes through AutoTokenizer."""
    model = build_model("tiny", Path.cwd() / ".models" / "tiny")
    code = ("import sys; from kvcentric.router.tokenize import PromptTokenizer; "
            f"t = PromptTokenizer({str(model)!r}); "
            "print('torch' in sys.modules, t.encode('hello  world').tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split(maxsplit=1)
    auto = AutoTokenizer.from_pretrained(str(model))
    assert out[0] == "False"  # torch was never imported
    assert out[1].strip() == str(list(auto("hello  world")["input_ids"]))
    tok = PromptTokenizer(model)
    assert tok.tok.chat_template == auto.chat_template
    assert type(tok.tok) is type(auto)
