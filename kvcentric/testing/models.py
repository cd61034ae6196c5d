"""Deterministic random-weight Llama checkpoints for tests and benchmarks.

``build_model(size, out_dir)`` writes a complete Hugging Face model directory
(``config.json``, ``generation_config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``) that vLLM and transformers load
like any real checkpoint.  Nothing is downloaded.

Contracts:

* Weights are a function of the :class:`ModelSpec` only (plus the suppressed
  ids below, fixed by the byte-level alphabet): every tensor is drawn from its
  own seeded ``torch.Generator`` integer stream (Mersenne Twister) and scaled
  with exact IEEE arithmetic, so the safetensors bytes are identical on any
  machine.  The tokenizer is trained by ``tokenizers`` on a corpus from a
  seeded ``random.Random``; its files are identical for a ``tokenizers`` version.
* Weights are stored in float32 and ``config.json`` says ``float32``.  vLLM's
  ``dtype="auto"`` turns float32 checkpoints into bfloat16 (CPU) / float16,
  which computes different tokens; pass ``dtype="float32"`` where tests compare
  token streams (bfloat16 leaves greedy argmax gaps within rounding noise).
* Linear weights use gain 2 (std ``2/sqrt(fan_in)``): attention is sharp enough
  that changing a past block of tokens changes most later argmaxes (so corrupted
  KV shows in outputs), while float32 noise stays ~1e4x below the typical top-1
  gap.  Greedy decoding yields varied tokens, not a fixed point.
* ``tokenizer`` is ``"bpe"`` (byte-level BPE; every text encodes) or ``"word"``
  (``tokenizers``' ``WordLevel`` over whitespace/punctuation pre-tokens, as some
  real models ship: no token carries a leading space, unknown words are ``<unk>``).
* Specials (``<unk>``=0, ``<s>``=1, ``</s>``=2, ``<pad>``=3) and tokens that are
  not printable ASCII have zero ``lm_head`` rows: their logit is exactly 0 while
  the others spread with std ``logit_std``, so the model practically never
  emits EOS (generations run to ``max_tokens`` even without ``ignore_eos``) and
  generated text is always printable ASCII.
* ``build_model`` is idempotent and cheap once built (it only reads the marker
  file ``kvcentric_model.json``), and safe under concurrent callers (``flock`` on
  ``<out_dir>.lock``; the model is written to a temp dir and renamed into place).

CLI: ``python -m kvcentric.testing.models --size tiny|tiny-word|bench --out DIR [--force]``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

SPEC_VERSION = 2  # bump whenever the bytes written for a given spec change
MARKER_FILE = "kvcentric_model.json"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3, in this order
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)

# Llama-2 style: plain-text markers, so no extra special tokens are needed.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "<<SYS>>\n{{ message['content'] }}\n<</SYS>>\n\n"
    "{% elif message['role'] == 'user' %}"
    "[INST] {{ message['content'] }} [/INST]"
    "{% elif message['role'] == 'assistant' %}"
    " {{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class ModelSpec:
    """Shape and init of a synthetic Llama.

    Linear weights have std ``init_gain / sqrt(fan_in)`` (so ``init_gain`` > 1
    sharpens attention and keeps activations large), ``o_proj``/``down_proj``
    are further divided by ``sqrt(2 * num_layers)``, embeddings have std 1,
    norms are 1, and ``lm_head`` is scaled so logits have std ``logit_std``.
    """

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    init_gain: float
    logit_std: float
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    dtype: str = "float32"
    seed: int = 1234
    tokenizer: str = "bpe"  # or "word" (see the module docstring)


SPECS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        name="tiny", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
        head_dim=64, intermediate_size=512, vocab_size=4096,
        max_position_embeddings=16384, init_gain=2.0, logit_std=4.0,
    ),
    "bench": ModelSpec(
        name="bench", hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
        head_dim=64, intermediate_size=2816, vocab_size=8192,
        max_position_embeddings=32768, init_gain=2.0, logit_std=4.0,
    ),
}
SPECS["tiny-word"] = replace(SPECS["tiny"], name="tiny-word", tokenizer="word")


def default_model_dir(size: str, base: str | Path | None = None) -> Path:
    """Return ``<base>/<size>``; ``base`` defaults to ``<cwd>/.models`` (gitignored)."""
    return Path(base if base is not None else Path.cwd() / ".models") / size


def get_spec(size: str) -> ModelSpec:
    """Return ``SPECS[size]``; raise ``ValueError`` naming the known sizes otherwise."""
    try:
        return SPECS[size]
    except KeyError:
        raise ValueError(f"unknown model size {size!r}; known: {sorted(SPECS)}") from None


def _marker(spec: ModelSpec) -> dict[str, Any]:
    d = asdict(spec)
    if d["tokenizer"] == "bpe":  # BPE models' markers predate the field: keep them valid
        del d["tokenizer"]
    return {"spec_version": SPEC_VERSION, "spec": d, "files": list(MODEL_FILES)}


def is_complete(out_dir: str | Path, spec: ModelSpec) -> bool:
    """True iff ``out_dir`` holds a finished build of exactly ``spec`` (marker + files)."""
    out = Path(out_dir)
    try:
        marker = json.loads((out / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker == _marker(spec) and all((out / f).is_file() for f in MODEL_FILES)


def build_model(size: str, out_dir: str | Path, *, force: bool = False) -> Path:
    """Write the ``size`` model to ``out_dir`` unless it is already there; return the dir.

    Idempotent: a complete build of the same spec is returned without touching
    it (``force=True`` rebuilds).  Concurrent callers serialize on
    ``<out_dir>.lock``; the files appear atomically (temp dir + rename).  An
    existing ``out_dir`` is only replaced if it is empty or was written by this
    module (it has a marker file); otherwise ``FileExistsError`` is raised.
    """
    spec = get_spec(size)

    def write(tmp: Path) -> None:
        tokenizer = write_tokenizer(spec, tmp)
        write_weights(spec, tmp, suppressed_token_ids(tokenizer))

    return build_dir(Path(out_dir), MARKER_FILE, _marker(spec),
                     lambda out: is_complete(out, spec), write, force)


def build_dir(out_dir: Path, marker: str, want: dict[str, Any],
              complete: Callable[[Path], bool], write: Callable[[Path], None],
              force: bool = False) -> Path:
    """Make ``out_dir`` hold what ``write(tmp)`` writes plus the ``marker`` file saying
    ``want``, unless ``complete(out_dir)`` (``force``: rebuild). Concurrent callers
    serialize on ``<out_dir>.lock``; the files appear atomically (temp dir + rename, the
    marker written last). An existing ``out_dir`` without the marker and not empty is
    never replaced (``FileExistsError``)."""
    out = out_dir.absolute()
    if not force and complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(out.parent / f"{out.name}.lock"):
        if not force and complete(out):
            return out
        if out.exists() and any(out.iterdir()) and not (out / marker).exists():
            raise FileExistsError(f"{out} exists and is not a kvcentric model dir")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            os.chmod(tmp, 0o755)
            write(tmp)
            _write_json(tmp / marker, want)  # last: marks completeness
            _swap_in(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block."""
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _swap_in(tmp: Path, out: Path) -> None:
    """Move ``tmp`` to ``out``, first renaming any old ``out`` aside and deleting it."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / "dir")
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- weights

_HALF = 1 << 20  # each uniform draw is an integer in [-2**20, 2**20)
_IRWIN_HALL_N = 4  # sum of 4 uniforms: close to normal, exact integer arithmetic


def _tensor_seed(spec: ModelSpec, name: str) -> int:
    digest = hashlib.sha256(f"{spec.seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _randn(spec: ModelSpec, name: str, shape: tuple[int, ...], std: float) -> Any:
    """Approximately normal float32 tensor with the given std, bit-identical everywhere.

    Only integer draws (``torch.randint``) and one float64 multiply are used, so
    no vectorized transcendental (which may differ across CPUs) is involved.
    """
    import torch

    gen = torch.Generator().manual_seed(_tensor_seed(spec, name))
    acc = torch.zeros(shape, dtype=torch.int64)
    for _ in range(_IRWIN_HALL_N):
        acc += torch.randint(-_HALF, _HALF, shape, generator=gen, dtype=torch.int64)
    unit = math.sqrt(_IRWIN_HALL_N * (2 * _HALF) ** 2 / 12)  # std of the integer sum
    return (acc.to(torch.float64) * (std / unit)).to(torch.float32)


def _layer_shapes(spec: ModelSpec) -> dict[str, tuple[tuple[int, int], float]]:
    """Per-layer linear weights: name suffix -> ((out, in), std)."""
    h, i = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    g, res = spec.init_gain, 1.0 / math.sqrt(2 * spec.num_layers)
    return {
        "self_attn.q_proj.weight": ((q, h), g / math.sqrt(h)),
        "self_attn.k_proj.weight": ((kv, h), g / math.sqrt(h)),
        "self_attn.v_proj.weight": ((kv, h), g / math.sqrt(h)),
        "self_attn.o_proj.weight": ((h, q), g * res / math.sqrt(q)),
        "mlp.gate_proj.weight": ((i, h), g / math.sqrt(h)),
        "mlp.up_proj.weight": ((i, h), g / math.sqrt(h)),
        "mlp.down_proj.weight": ((h, i), g * res / math.sqrt(i)),
    }


def make_state_dict(spec: ModelSpec, suppressed_ids: list[int]) -> dict[str, Any]:
    """Return the HF ``LlamaForCausalLM`` state dict (float32 tensors) for ``spec``.

    ``lm_head`` rows of ``suppressed_ids`` are zero (logit exactly 0, never the argmax).
    """
    import torch

    h, v = spec.hidden_size, spec.vocab_size
    sd: dict[str, Any] = {"model.embed_tokens.weight": _randn(spec, "embed", (v, h), 1.0)}
    for layer in range(spec.num_layers):
        pre = f"model.layers.{layer}."
        sd[pre + "input_layernorm.weight"] = torch.ones(h)
        sd[pre + "post_attention_layernorm.weight"] = torch.ones(h)
        for suffix, (shape, std) in _layer_shapes(spec).items():
            sd[pre + suffix] = _randn(spec, pre + suffix, shape, std)
    sd["model.norm.weight"] = torch.ones(h)
    lm_head = _randn(spec, "lm_head", (v, h), spec.logit_std / math.sqrt(h))
    lm_head[torch.tensor(suppressed_ids, dtype=torch.long)] = 0.0
    sd["lm_head.weight"] = lm_head
    return sd


def write_weights(spec: ModelSpec, out_dir: Path, suppressed_ids: list[int]) -> None:
    """Write ``model.safetensors`` (``spec.dtype``), ``config.json``, ``generation_config.json``."""
    import torch
    from safetensors.torch import save_file

    weights = out_dir / "model.safetensors"
    dtype = getattr(torch, spec.dtype)
    tensors = {k: v.to(dtype) for k, v in make_state_dict(spec, suppressed_ids).items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    os.chmod(weights, 0o644)
    _write_json(out_dir / "config.json", hf_config(spec))
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        "do_sample": False, "_from_model_config": False,
    })


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """Return the ``config.json`` contents for ``spec``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": spec.dtype,
        "use_cache": True,
    }


# --------------------------------------------------------------------------- tokenizer

_ONSETS = ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t",
           "v", "w", "st", "th", "ch", "sh", "pr", "tr", "gr", "bl")
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "nd", "ng", "st", "ck")
_PUNCT = (".", ",", "!", "?", ";", ":")


def _corpus(seed: int, n_lines: int = 6000) -> Iterator[str]:
    """Deterministic pseudo-English lines (syllable words, capitals, digits, punctuation)."""
    rng = random.Random(seed)
    for _ in range(n_lines):
        words = []
        for _ in range(rng.randint(6, 16)):
            word = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                           for _ in range(rng.randint(1, 3)))
            r = rng.random()
            if r < 0.1:
                word = word.capitalize()
            elif r < 0.15:
                word = str(rng.randint(0, 9999))
            words.append(word)
        yield " ".join(words) + rng.choice(_PUNCT)


def make_tokenizer(spec: ModelSpec) -> Any:
    """Train a ``tokenizers.Tokenizer`` (``spec.tokenizer``) with ``spec.vocab_size`` ids.

    BPE: any UTF-8 text encodes (byte fallback, no ``<unk>``).  Word: the corpus's most
    frequent words and punctuation marks, anything else is ``<unk>``.  Encodings get
    ``<s>`` prepended.  Raises ``RuntimeError`` if training falls short of the vocab size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    trainer: Any
    if spec.tokenizer == "word":
        tok = Tokenizer(models.WordLevel(unk_token=SPECIAL_TOKENS[UNK_ID]))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordLevelTrainer(vocab_size=spec.vocab_size, show_progress=False,
                                            special_tokens=list(SPECIAL_TOKENS))
    elif spec.tokenizer == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=spec.vocab_size, special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        )
    else:
        raise ValueError(f"unknown tokenizer kind {spec.tokenizer!r}: 'bpe' or 'word'")
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    if tok.get_vocab_size() != spec.vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, want {spec.vocab_size}")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)],
    )
    return tok


def suppressed_token_ids(tokenizer: Any) -> list[int]:
    """Ids the model must never generate: specials and tokens that are not printable ASCII.

    Only single-byte tokens qualify besides the specials (the training corpus is
    printable ASCII), so generated text is always clean, valid UTF-8.
    """
    n = tokenizer.get_vocab_size()
    texts = tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    return [i for i, t in enumerate(texts)
            if i < len(SPECIAL_TOKENS) or not (t.isascii() and t.isprintable())]


def write_tokenizer(spec: ModelSpec, out_dir: Path) -> Any:
    """Write ``tokenizer.json`` and ``tokenizer_config.json``; return the tokenizer."""
    tokenizer = make_tokenizer(spec)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    })
    return tokenizer


# -------------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    """CLI entry point: build a model and print its directory."""
    parser = argparse.ArgumentParser(description="Build a deterministic random-weight Llama.")
    parser.add_argument("--size", choices=sorted(SPECS), required=True)
    parser.add_argument("--out", type=Path, default=None,
                        help="output dir (default: ./.models/<size>)")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else default_model_dir(args.size)
    print(build_model(args.size, out, force=args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
