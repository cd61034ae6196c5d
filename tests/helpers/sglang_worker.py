"""Subprocess for the SGLang backend tests: read pages another process stored.

    python tests/helpers/sglang_worker.py SPEC_JSON
    python tests/helpers/sglang_worker.py -    # SPEC_JSON as one line on stdin

``-`` reads the spec once SGLang is imported: a test can start the reader early, so that
its import overlaps the writer's, and send the spec when the writer is done.
``SPEC_JSON``: ``{"store": {...}, "cases": {"ID": {"mla": bool, "layout": str,
"model": str, "keys": [...], "pages": [...]}}}``. For each case, creates the backend
through SGLang's ``StorageBackendFactory``, registers a fresh (zeroed) host pool, runs
``batch_exists`` and ``batch_get_v1`` into ``pages``, and prints one JSON object:
``{"ID": {"exists": n, "loaded": [bool...], "digests": [hex...], "others_zero": bool}}``.

Optional per case: ``"pool"``, keyword arguments of ``make_pool`` (the writer's page
geometry, when not the default); ``"exists_each": true`` adds ``"exists_each"``, the
single-key ``exists`` of every key (asked before the load, like ``batch_exists``).
"""

from __future__ import annotations

import json
import sys

import xxhash

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from tests.helpers.sglang_pool import indices, make_pool, page_bytes  # noqa: E402
from tests.helpers.sglang_setup import storage_config  # noqa: E402


def read_case(store: dict, case: dict) -> dict:  # type: ignore[type-arg]
    cfg = storage_config(store, mla=case["mla"], layout=case["layout"], model=case["model"])
    backend = StorageBackendFactory.create_backend("dynamic", cfg, None)
    pool = make_pool(case["mla"], case["layout"], **case.get("pool", {}))
    backend.register_mem_pool_host(pool)
    pages, keys = case["pages"], case["keys"]
    extra = {}
    try:
        if case.get("exists_each"):
            extra["exists_each"] = [backend.exists(k) for k in keys]
        exists = backend.batch_exists(keys)
        loaded = backend.batch_get_v1(keys, indices(pool, pages))
    finally:
        backend.close()
    others = [p for p in range(pool.page_num) if p not in pages]
    return {"exists": exists, "loaded": loaded,
            "digests": [xxhash.xxh3_64_hexdigest(page_bytes(pool, p)) for p in pages],
            "others_zero": all(not any(page_bytes(pool, p)) for p in others), **extra}


def main() -> None:
    spec = json.loads(sys.stdin.readline() if sys.argv[1] == "-" else sys.argv[1])
    print(json.dumps({cid: read_case(spec["store"], case)
                      for cid, case in spec["cases"].items()}))


if __name__ == "__main__":
    main()
