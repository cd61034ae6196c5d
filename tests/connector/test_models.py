"""Tests for kvcentric.testing.models: the synthetic random-weight Llama checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest

from kvcentric.testing import models
from kvcentric.testing.models import MARKER_FILE, MODEL_FILES, SPECS, build_model

ENGLISH = "The quick brown fox jumps over the lazy dog. It was a bright cold day in April!"


def _digests(d: Path) -> dict[str, str]:
    return {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in MODEL_FILES}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("tiny", tmp_path_factory.mktemp("models") / "tiny")


def test_files_and_config(tiny_dir: Path) -> None:
    spec = SPECS["tiny"]
    for f in (*MODEL_FILES, MARKER_FILE):
        assert (tiny_dir / f).is_file(), f
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["hidden_size"] == spec.hidden_size
    assert cfg["num_attention_heads"] == spec.num_heads
    assert cfg["num_key_value_heads"] == spec.num_kv_heads < spec.num_heads  # GQA
    assert cfg["head_dim"] == spec.head_dim == 64
    assert cfg["num_hidden_layers"] == spec.num_layers
    assert cfg["vocab_size"] == spec.vocab_size
    assert cfg["max_position_embeddings"] >= 8192
    assert cfg["torch_dtype"] == "float32"
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"] == models.EOS_ID
    marker = json.loads((tiny_dir / MARKER_FILE).read_text())
    assert marker["spec_version"] == models.SPEC_VERSION
    assert marker["spec"]["name"] == "tiny"
    assert models.is_complete(tiny_dir, spec)
    assert not models.is_complete(tiny_dir, SPECS["bench"])


def test_deterministic_and_force_rebuild(tiny_dir: Path, tmp_path: Path) -> None:
    other = build_model("tiny", tmp_path / "a" / "tiny")
    assert _digests(other) == _digests(tiny_dir)
    # rebuilt: a new file, not the old one kept (held open, so its inode is not reused)
    with open(other / "model.safetensors", "rb") as old:
        build_model("tiny", other, force=True)
        assert (other / "model.safetensors").stat().st_ino != os.fstat(old.fileno()).st_ino
    assert _digests(other) == _digests(tiny_dir)
    assert not [p for p in other.parent.iterdir() if p.name.startswith(".")]  # no temp leftovers


# serial (tests/helpers/xdist_groups.py): it bounds a call's wall time
@pytest.mark.serial
def test_idempotent_call_is_fast(tiny_dir: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A call on a complete model writes nothing and costs a small part of a build: the
    fastest of three (a pause of this process lengthens one call, not all three) is under
    a tenth of a build timed in this test, on this machine, now."""
    mtime = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    build_model("tiny", tmp_path / "baseline" / "tiny")
    build_s = time.perf_counter() - t0
    calls = []
    for _ in range(3):
        t0 = time.perf_counter()
        assert build_model("tiny", str(tiny_dir)) == tiny_dir
        calls.append(time.perf_counter() - t0)
    assert min(calls) < build_s / 10, (calls, build_s)
    assert models.main(["--size", "tiny", "--out", str(tiny_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(tiny_dir)
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_concurrent_builders_share_one_build(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(build_model("tiny", out)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [out, out]
    assert models.is_complete(out, SPECS["tiny"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny", "tiny.lock"]


def test_refuses_foreign_dir_and_unknown_size(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_model("tiny", tmp_path)
    assert (tmp_path / "precious.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="unknown model size"):
        build_model("huge", tmp_path / "x")


def test_default_model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert models.default_model_dir("tiny") == tmp_path / ".models" / "tiny"
    assert models.default_model_dir("bench", "/x") == Path("/x/bench")


def test_tokenizer_round_trip_and_chat_template(tiny_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tok) == SPECS["tiny"].vocab_size
    assert (tok.bos_token_id, tok.eos_token_id) == (models.BOS_ID, models.EOS_ID)
    ids = tok(ENGLISH)["input_ids"]
    assert ids[0] == models.BOS_ID
    assert len(ids) > len(ENGLISH.split()) * 1.5  # ordinary English splits into many tokens
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == ENGLISH
    assert tok(text)["input_ids"] == ids
    exotic = "naïve café 😀"  # byte fallback: any UTF-8 round-trips
    assert tok.decode(tok(exotic)["input_ids"], skip_special_tokens=True) == exotic
    chat = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False, add_generation_prompt=True,
    )
    assert chat == "<s><<SYS>>\nBe brief.\n<</SYS>>\n\n[INST] Hi [/INST]"


def test_transformers_greedy_generate_is_deterministic_and_varied(tiny_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.dtype == torch.float32
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, SPECS["tiny"].vocab_size, (2, 300), generator=gen)
    outs = []
    for _ in range(2):
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=16, do_sample=False)
        outs.append(out[:, prompt.shape[1]:])
    assert outs[0].shape == (2, 16)  # no early EOS
    assert torch.equal(outs[0], outs[1])
    for row in outs[0].tolist():
        assert len(set(row)) >= 8, row
        assert models.EOS_ID not in row
    text = transformers.AutoTokenizer.from_pretrained(tiny_dir).decode(outs[0][0])
    assert text.isascii() and text.isprintable()
