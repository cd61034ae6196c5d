"""CUDA graphs and our connector, decided by vLLM's own code (runs on CPU).

vLLM on a GPU resolves ``cudagraph_mode`` in ``VllmConfig.__post_init__`` and asks every
KV connector ``requires_piecewise_for_cudagraph``. Our answer keeps
``FULL_AND_PIECEWISE`` (its full-graph steps are made safe in the worker: see
tests/gpu/test_cuda_graphs.py for a real capture and replay) unless the operator asks
for PIECEWISE. The worker learns whether a step runs its layer hooks from the forward
context vLLM hands ``start_load_kv``: a full-graph step, or a context outside any
forward (model runner v2 starts a full graph's loads there), runs none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.config import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    KVTransferConfig,
    ModelConfig,
    VllmConfig,
)
from vllm.forward_context import create_forward_context
from vllm.platforms import current_platform

from kvcentric.connector.vllm.connector import KVCentricConnector, layer_hooks_run
from kvcentric.testing.models import build_model


@pytest.fixture(scope="module")
def tiny_model() -> str:
    return str(build_model("tiny", Path.cwd() / ".models" / "tiny"))


def gpu_config(model: str, extra: dict[str, Any], monkeypatch: pytest.MonkeyPatch
               ) -> VllmConfig:
    """``VllmConfig`` as vLLM resolves it on a GPU: a platform with static graphs and
    vLLM's compiler, and the user's (default) ``FULL_AND_PIECEWISE``."""
    platform = type(current_platform)
    monkeypatch.setattr(platform, "support_static_graph_mode", classmethod(lambda cls: True))
    monkeypatch.setattr(platform, "check_and_update_config", classmethod(lambda cls, c: None))
    kv = KVTransferConfig(kv_connector="KVCentricConnector",
                          kv_connector_module_path="kvcentric.connector.vllm",
                          kv_role="kv_both", kv_connector_extra_config=extra)
    return VllmConfig(model_config=ModelConfig(model=model),
                      compilation_config=CompilationConfig(
                          mode=CompilationMode.VLLM_COMPILE,
                          cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE),
                      kv_transfer_config=kv)


def test_vllm_keeps_full_graphs_with_us_unless_asked_for_piecewise(
        tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not KVCentricConnector.requires_piecewise_for_cudagraph({})
    assert KVCentricConnector.requires_piecewise_for_cudagraph({"full_cudagraphs": False})
    with pytest.raises(ValueError):
        KVCentricConnector.requires_piecewise_for_cudagraph({"full_cudagraphs": "maybe"})
    kept = gpu_config(tiny_model, {}, monkeypatch)
    assert kept.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    split = gpu_config(tiny_model, {"full_cudagraphs": False}, monkeypatch)
    assert split.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE

    # what the worker concludes from the forward context of each kind of step
    meta = {"model.layers.0.self_attn.attn": object()}
    for mode, hooks in ((CUDAGraphMode.NONE, True), (CUDAGraphMode.PIECEWISE, True),
                        (CUDAGraphMode.FULL, False)):
        ctx = create_forward_context(meta, kept, cudagraph_runtime_mode=mode)
        assert layer_hooks_run(ctx) is hooks, mode
    # no forward, or model runner v2's full-graph loads outside any forward context
    assert not layer_hooks_run(create_forward_context(None, kept))
    assert not layer_hooks_run(None)
