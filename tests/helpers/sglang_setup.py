"""SGLang storage configs, backends and page keys (used in the tests' subprocesses)."""

from __future__ import annotations

import hashlib
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

# What a user passes as --hicache-storage-backend-extra-config, minus the store.
FACTORY_KEYS = {"backend_name": "kvcentric", "module_path": "kvcentric.connector.sglang",
                "class_name": "KVCentricHiCacheStorage", "interface_v1": 1}


def storage_config(store: dict[str, Any], *, mla: bool = False, layout: str = "page_first",
                   model: str | None = "m", tp_rank: int = 0, tp_size: int = 1,
                   metrics: bool = True, **extra: Any) -> HiCacheStorageConfig:
    """The ``HiCacheStorageConfig`` SGLang's cache controller builds for one rank."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
        is_page_first_layout=layout == "page_first", model_name=model,
        extra_config={**FACTORY_KEYS, "kvcentric": {"store": dict(store), **extra}})


def page_keys(tag: str, n: int) -> list[str]:
    """``n`` chained page hashes in SGLang's form (64 hex characters)."""
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{tag}/{i}".encode()).digest()
        out.append(prev.hex())
    return out


def create(store: dict[str, Any], pool: Any = None, **kw: Any) -> Any:
    """A backend made by SGLang's factory (as its cache controller does), with ``pool``
    registered when given."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvcentric.connector.sglang import KVCentricHiCacheStorage

    backend = StorageBackendFactory.create_backend("dynamic", storage_config(store, **kw), None)
    assert type(backend) is KVCentricHiCacheStorage, type(backend)
    if pool is not None:
        backend.register_mem_pool_host(pool)
    return backend
