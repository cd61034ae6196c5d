"""bench_serving with a tokenizer that has no "space + letters" tokens (a word-level one):
token-id prompts on /v1/completions, a clear refusal for chat, and a whole run against a
real vLLM CPU server serving such a model, with each instance's load sampled."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.serving import loadgen  # the repository's runs: result files with figures
from kvcentric.bench_serving.runner import prompt_kind
from kvcentric.bench_serving.tokens import TokenSource
from kvcentric.bench_serving.workloads import WorkloadSpec, build
from kvcentric.testing import models
from kvcentric.testing.models import build_model
from kvcentric.testing.servers import VllmServer

VLLM_BLOCK = 128
OUT = 128  # tokens per answer: long enough a run for the load sampler to see it busy


@pytest.fixture(scope="module")
def word_model() -> str:
    return str(build_model("tiny-word", Path.cwd() / ".models" / "tiny-word"))


@pytest.fixture(scope="module")
def word_src(word_model: str) -> TokenSource:
    return TokenSource(word_model)


def test_word_level_tokenizer_gets_token_id_prompts(word_src: TokenSource) -> None:
    marker = json.loads((Path(word_src.path) / models.MARKER_FILE).read_text())
    assert marker["spec"]["tokenizer"] == "word"
    assert "tokenizer" not in models._marker(models.SPECS["tiny"])["spec"]  # BPE builds stay valid
    tok = word_src.tok
    assert type(tok.backend_tokenizer.model).__name__ == "WordLevel"
    assert not word_src.text_exact and "0 word tokens" in (word_src.text_problem or "")
    special = set(tok.all_special_ids)
    assert len(word_src.words) == len(tok) - len(special) and not special & set(word_src.words)
    # why text cannot work: two words' texts glue into one unknown word
    a, b = word_src.words[100], word_src.words[200]
    assert word_src.encode(word_src.text([a]) + word_src.text([b]), special=False) != [a, b]
    assert prompt_kind(word_src, "completions", "auto") == "ids"
    with pytest.raises(ValueError, match="not token-exact"):
        prompt_kind(word_src, "completions", "text")
    with pytest.raises(ValueError, match="needs a text tokenizer.*--endpoint completions"):
        prompt_kind(word_src, "chat", "auto")
    wl = build(WorkloadSpec(workload="hit-ratio", input_len=64, num_prompts=2), word_src)
    assert all(set(s.turns[0].user) <= set(word_src.words) for s in wl.sessions)


def test_a_bpe_tokenizer_still_sends_text(word_model: str) -> None:
    src = TokenSource(str(build_model("tiny", Path.cwd() / ".models" / "tiny")))
    assert src.text_exact and src.text_problem is None
    assert prompt_kind(src, "completions", "auto") == "text"
    assert prompt_kind(src, "chat", "ids") == "chat"


@pytest.mark.parametrize(("flags", "needle"), [
    (["--endpoint", "chat"], "--endpoint chat needs a text tokenizer"),
    (["--prompt-format", "text"], "--prompt-format text is not token-exact"),
])
def test_cli_explains_what_the_tokenizer_cannot_do(word_model: str, flags: list[str],
                                                    needle: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        loadgen.main(["--base-url", "http://127.0.0.1:9", "--model", "m",
                            "--tokenizer", word_model, *flags])
    assert exc.value.code == 2  # argparse's usage error, not a traceback
    err = capsys.readouterr().err
    assert needle in err and "0 word tokens" in err


@pytest.fixture(scope="module")
def word_server(word_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("bench-word") / "vllm.log"
    srv = VllmServer(word_model, "tiny-word", log_path=log,
                     args=["--enable-prompt-tokens-details"])
    try:
        srv.start().wait_ready()
        yield srv
    finally:
        srv.stop()


@contextlib.contextmanager
def _decoding(server: VllmServer, prompt: list[int]) -> Iterator[Callable[[], bool]]:
    """A streamed request decoding to the context's end (EOS ignored), in the engine's
    batch from its first token until the block exits (closing the stream aborts it).
    Yields a check that it is decoding still: its next chunk carries no finish reason."""
    body = {"model": server.name, "prompt": prompt, "stream": True, "ignore_eos": True,
            "max_tokens": server.max_model_len - len(prompt), "temperature": 0.0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        lines = (x for x in r.iter_lines() if x.startswith("data: "))

        def decoding() -> bool:
            line = next(lines, "data: [DONE]")
            return line != "data: [DONE]" and \
                json.loads(line[6:])["choices"][0].get("finish_reason") is None

        assert decoding(), "the background request never started"  # its first token
        yield decoding


@pytest.mark.vllm
def test_multi_turn_run_against_vllm_serving_a_word_level_model(
        word_server: VllmServer, word_model: str, word_src: TokenSource, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "word.json"
    with _decoding(word_server, list(word_src.words[:8])) as still_decoding:
        rc = loadgen.main(["--base-url", word_server.url, "--tokenizer", word_model,
                           "--workload", "multi-turn", "--num-users", "3", "--turns-mean", "3",
                           "--shared-system-prompt-len", "256", "--user-context-len", "128",
                           "--turn-input-len", "32", "--output-len", str(OUT), "--seed", "21",
                           "--sample-interval", "0.05", "--out", str(out), "--disable-tqdm"])
        assert still_decoding(), "the background request ended before the run did"
    assert rc == 0
    printed = capsys.readouterr().out
    assert "sending token-id prompts on /v1/completions" in printed
    assert "Instance utilisation" in printed
    doc = json.loads(out.read_text())
    assert doc["config"]["prompt_format"] == "ids"
    assert doc["config"]["prompt_format_requested"] == "auto"
    s = doc["summary"]
    assert (s["completed"], s["failed"], s["aborted_turns"]) == (9, 0, 0)
    recs = doc["requests"]
    for r in recs:
        assert r["success"] and r["prompt_len"] == r["server_prompt_tokens"]
        assert r["output_tokens"] == OUT
    for user in {r["sid"] for r in recs}:
        lens = [r["prompt_len"] for r in sorted(recs, key=lambda r: r["turn"])
                if r["sid"] == user]
        # BOS + system + context + turn; each answer re-encodes to exactly its OUT tokens
        assert lens[0] == 1 + 256 + 128 + 32
        assert [b - a for a, b in zip(lens, lens[1:])] == [OUT + 32] * 2
    # turns 2 and 3 hit at least the previous prompt's full blocks in vLLM's prefix cache
    assert s["hit_tokens"] >= 3 * 2 * (lens[0] // VLLM_BLOCK) * VLLM_BLOCK
    util = doc["utilisation"]["per_instance"][word_server.url]
    # how many samples land is timing (the unit tests pin the statistics on scripted
    # gauges); the run lasts ~3 s (8-token answers gave 0.3 s, and under the full suite's
    # load once not one sample), so at least one must, from the real server; a request
    # decoding through the whole run makes every one of them see the engine busy (the
    # run's own requests alone left all 5 samples of one loaded run between requests)
    assert util["answered"] >= 1 and 0 < util["busy_fraction"] <= 1
    assert util["running_mean"] > 0 and 0 < util["kv_usage_max"] <= 1
    samples = doc["utilisation_samples"][word_server.url]
    assert len(samples["t_s"]) == util["samples"] and samples["t_s"] == sorted(samples["t_s"])
    assert doc["figures"] == [{"file": "word_utilisation.png", "title": doc["figures"][0]["title"]}]
    assert (tmp_path / "word_utilisation.png").read_bytes()[:4] == b"\x89PNG"
    assert doc["meta"]["command"].startswith("python -m benchmarks.serving.loadgen --base-url")
    assert doc["meta"]["machine"]["cpus"] >= 1
