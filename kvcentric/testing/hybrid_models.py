"""Tiny random-weight models of the attention kinds beyond plain Llama, for vLLM CPU tests.

``build_hybrid(kind, out_dir)`` writes a Hugging Face model directory (config, float32
safetensors, and the ``tiny`` model's tokenizer from :mod:`kvcentric.testing.models`)
that vLLM loads like a real checkpoint. Nothing is downloaded. Kinds:

* ``gemma3-sliding``: ``Gemma3ForCausalLM``, 6 layers, a 256-token sliding window on 4 of
  them (two KV cache groups under vLLM's hybrid manager: full and sliding window).
* ``lfm2``: ``Lfm2ForCausalLM``, short-conv layers between attention layers (a recurrent
  ``MambaSpec`` group: the state is the conv cache; mode ``align`` on vLLM CPU).
* ``nemotron-h``: ``NemotronHForCausalLM`` (Mamba2 + attention + MLP layers). vLLM CPU
  0.32 serves it only without prefix caching (mode ``none``): with it, the CPU chunk scan
  returns no intermediate states and the first prefill fails (``IndexError: index 5 is out
  of bounds for dimension 0 with size 1`` in ``mamba_mixer2.conv_ssm_forward``).
* ``deepseek-mla``: ``DeepseekV2ForCausalLM`` with MLA (latent 512 + rope 64 = 576, what
  vLLM CPU's MLA kernel supports; block size 16; no prefix caching on CPU).

Weights come from transformers' own initialisation with ``initializer_range`` 0.25 (a
default 0.02 init leaves near-tied logits, so greedy tokens drift between runs for
reasons unrelated to KV) under a fixed torch seed: the same bytes for a torch and
transformers version. Builds are idempotent (a marker file names the kind and the
config) and safe under concurrent callers (``flock``; written to a temp dir, renamed).

CLI: ``python -m kvcentric.testing.hybrid_models --kind KIND --out DIR``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvcentric.testing.models import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    _write_json,
    build_dir,
    get_spec,
    write_tokenizer,
)

VERSION = 1  # bump when the bytes written for a kind change
MARKER = "kvcentric_hybrid.json"
INIT_RANGE = 0.25
SEED = 1234

_BASE: dict[str, Any] = {
    "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 8192,
    "initializer_range": INIT_RANGE, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID, "tie_word_embeddings": False,
}

KINDS: dict[str, tuple[str, str, dict[str, Any]]] = {  # kind -> (config class, arch, fields)
    "gemma3-sliding": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "num_hidden_layers": 6, "head_dim": 64, "sliding_window": 256,
        "query_pre_attn_scalar": 64,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {
        "num_hidden_layers": 4, "layer_types": ["conv", "full_attention"] * 2,
        "conv_L_cache": 3, "block_ff_dim": 512, "block_auto_adjust_ff_dim": False,
        # fields vLLM 0.32's Lfm2 reads that transformers 5 no longer writes
        "conv_dim": 256, "conv_dim_out": 256, "block_dim": 256, "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0, "norm_eps": 1e-5}),
    "nemotron-h": ("NemotronHConfig", "NemotronHForCausalLM", {
        "num_hidden_layers": 4, "hybrid_override_pattern": "M*M-", "mamba_num_heads": 8,
        "mamba_head_dim": 64, "n_groups": 1, "ssm_state_size": 16, "conv_kernel": 4,
        "expand": 2, "chunk_size": 128, "head_dim": 64}),
    "deepseek-mla": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        "num_hidden_layers": 3, "num_key_value_heads": 4, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32,
        "v_head_dim": 32, "first_k_dense_replace": 3, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "n_shared_experts": 1}),
}


def _marker(kind: str) -> dict[str, Any]:
    cls, arch, fields = KINDS[kind]
    return {"version": VERSION, "kind": kind, "config": cls, "arch": arch,
            "fields": {**_BASE, **fields}, "seed": SEED}


def is_complete(out_dir: str | Path, kind: str) -> bool:
    """True iff ``out_dir`` holds a finished build of ``kind``."""
    try:
        return bool(json.loads((Path(out_dir) / MARKER).read_text()) == _marker(kind))
    except (OSError, ValueError):
        return False


def build_hybrid(kind: str, out_dir: str | Path, *, force: bool = False) -> Path:
    """Write the ``kind`` model to ``out_dir`` unless it is already there; return the dir
    (``ValueError`` for an unknown kind)."""
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; known: {sorted(KINDS)}")

    def write(tmp: Path) -> None:
        _write_model(kind, tmp)
        write_tokenizer(get_spec("tiny"), tmp)

    return build_dir(Path(out_dir), MARKER, _marker(kind),
                     lambda out: is_complete(out, kind), write, force)


def _write_model(kind: str, out: Path) -> None:
    import torch
    import transformers

    cls, arch, fields = KINDS[kind]
    config = getattr(transformers, cls)(**{**_BASE, **fields})
    config.architectures = [arch]
    for name, value in fields.items():  # keep what the class's own fields dropped
        if not hasattr(config, name):
            setattr(config, name, value)
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    _write_json(out / "generation_config.json", {
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        "do_sample": False, "_from_model_config": False})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a tiny random-weight hybrid model.")
    parser.add_argument("--kind", choices=sorted(KINDS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    print(build_hybrid(args.kind, args.out, force=args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
