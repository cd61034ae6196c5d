"""vLLM workers for the data-path benchmarks, without vLLM: a real ``KVCentricWorker`` over
caches the benchmark laid out as vLLM does, on its own connection to a real store."""

from __future__ import annotations

import torch

from kvcentric.config import StoreConfig
from kvcentric.connector.vllm.engine_layout import EngineLayout
from kvcentric.connector.vllm.settings import ConnectorSettings
from kvcentric.connector.vllm.worker import KVCentricWorker
from kvcentric.store import open_store


def worker_on(cfg: StoreConfig, engine: EngineLayout,
              kv: dict[str, torch.Tensor]) -> KVCentricWorker:
    """A worker of ``engine`` with ``kv`` (layer name -> cache tensor) registered, as
    vLLM's model runner registers its caches; the caller closes it."""
    w = KVCentricWorker(ConnectorSettings(store=cfg), engine, open_store(cfg), list(kv))
    w.register(kv)
    return w
