"""Random-weight LoRA adapters for the test models, in PEFT's on-disk format.

``build_lora(size, out_dir, seed)`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` that vLLM (``--enable-lora --lora-modules name=dir``)
loads like any adapter from the hub. Every attention projection gets a rank-``r``
update whose ``B`` is not zero, so the adapter changes the K and V a prompt produces:
two adapters' KV of one prompt differ, as real adapters' do. Weights are a function of
the model spec, ``seed`` and ``r`` only (seeded integer draws, as the models are).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from kvcentric.testing.models import _randn, get_spec

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def build_lora(size: str, out_dir: str | Path, seed: int, rank: int = 8) -> Path:
    """Write a LoRA adapter for model ``size`` to ``out_dir`` (replacing its files);
    return the directory."""
    from safetensors.torch import save_file

    spec = replace(get_spec(size), seed=seed)
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    dims = {"q_proj": (q, spec.hidden_size), "k_proj": (kv, spec.hidden_size),
            "v_proj": (kv, spec.hidden_size), "o_proj": (spec.hidden_size, q)}
    tensors = {}
    for layer in range(spec.num_layers):
        for target in TARGETS:
            out_f, in_f = dims[target]
            name = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{name}.lora_A.weight"] = _randn(spec, f"{name}.A", (rank, in_f),
                                                      in_f ** -0.5)
            tensors[f"{name}.lora_B.weight"] = _randn(spec, f"{name}.B", (out_f, rank),
                                                      rank ** -0.5)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "target_modules": list(TARGETS), "modules_to_save": None,
              "base_model_name_or_path": size}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    os.chmod(out / "adapter_model.safetensors", 0o644)
    return out
