"""kvcentric as SGLang's HiCache L3 storage backend; see docs/sglang.md.

- ``storage``: ``KVCentricHiCacheStorage``, the ``HiCacheStorage`` SGLang constructs.
- ``pages``: page geometry and keys of SGLang's host pool; ``page_io``: moving pages
  between the host pool and the store; ``settings``: the extra config parsed once;
  ``stats``: counters.

SGLang's ``module_path: kvcentric.connector.sglang`` with ``class_name:
KVCentricHiCacheStorage`` keeps working: the class is resolved on first attribute access,
so importing a submodule never imports SGLang.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVCentricHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVCentricHiCacheStorage":
        from kvcentric.connector.sglang.storage import KVCentricHiCacheStorage

        return KVCentricHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
