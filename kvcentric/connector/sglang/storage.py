"""SGLang HiCache storage backend: kvcentric's stores as SGLang's L3 KV tier.

Loaded by SGLang's own factory::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name":"kvcentric","module_path":"kvcentric.connector.sglang",
        "class_name":"KVCentricHiCacheStorage","interface_v1":1,
        "store":{"backend":"local","capacity":"32gb"}}'

SGLang constructs the class as ``cls(storage_config, {})`` and hands over its host KV
pool with :meth:`register_mem_pool_host`. With ``"interface_v1": 1`` it then calls the
zero-copy interface: :meth:`batch_exists` (leading hits), :meth:`batch_get_v1` and
:meth:`batch_set_v1` (pages moved straight between the host pool and the store); without
it, the legacy tensor interface (:meth:`get`, :meth:`set`, :meth:`batch_get`,
:meth:`batch_set`, :meth:`exists`). Both store the same object per page under the same
key (see :mod:`kvcentric.connector.sglang.pages`), so SGLang instances of one model share KV.

Memory: the host pool's buffers belong to SGLang; they are registered with the store
once (RDMA backends need that) and must outlive this object. Pages move between pool
memory and the store's slots and leases, one memcpy per segment
(:mod:`kvcentric.connector.sglang.page_io`).

Integrity, always on: every object, through either interface, starts with a header
naming the page it was written for (its SGLang page hash, token count, the key space's
model, layout and rank, its size; :mod:`kvcentric.integrity`,
:mod:`kvcentric.connector.sglang.pages`). Every load checks it before a byte reaches the
host pool or a legacy target; an object that names anything else reads as a miss,
counted as ``integrity_errors`` in :meth:`get_stats` and logged.

Failures never raise into SGLang: a missing key, a full store, a store that is down or
slow all read as "not stored" (``False`` / ``0`` / ``None``), and SGLang recomputes.
Hybrid models' side pools (Mamba / SWA / DSA, SGLang's v2 interface) are not stored
yet: they read as misses.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)

from kvcentric.compat import TESTED_SGLANG, check_engine, missing_attrs
from kvcentric.connector.sglang.page_io import (
    Loaded,
    legacy_target,
    load_objects,
    load_pages,
    save_objects,
    save_pages,
)
from kvcentric.connector.sglang.pages import PageGeometry, page_geometry
from kvcentric.connector.sglang.settings import SGLangSettings
from kvcentric.connector.sglang.stats import SGLangStats
from kvcentric.integrity import HEADER_BYTES
from kvcentric.store import OK, KVStore, open_store

log = logging.getLogger("kvcentric.connector.sglang")


def check_sglang() -> None:
    """The installed SGLang against :data:`kvcentric.compat.TESTED_SGLANG` and the
    zero-copy v1 interface this backend implements."""
    import sglang

    missing = missing_attrs(HiCacheStorage, ("batch_exists", "batch_get_v1", "batch_set_v1",
                                             "register_mem_pool_host"), "HiCacheStorage")
    check_engine("SGLang", str(sglang.__version__), TESTED_SGLANG, missing, patches=False)


class KVCentricHiCacheStorage(HiCacheStorage):
    """A ``HiCacheStorage`` over a kvcentric :class:`~kvcentric.store.KVStore`.

    ``storage_config.extra_config`` carries the settings (:class:`SGLangSettings`); a bad
    value raises ``ValueError`` here, at start-up. A store that cannot be reached only
    logs: calls fail fast until it is back (retried every ``reopen_interval_s``).
    """

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: dict[str, Any] | None = None) -> None:
        check_sglang()
        super().__init__()
        self.settings = SGLangSettings.from_extra_config(storage_config.extra_config)
        model_id = self.settings.model_id or storage_config.model_name
        if not model_id:
            raise ValueError("kvcentric needs a model id: SGLang passed no model_name, "
                             "set \"model_id\" in --hicache-storage-backend-extra-config")
        self.model_id: str = model_id
        self.storage_config = storage_config
        self.stats = SGLangStats(bool(storage_config.enable_storage_metrics))
        self.geometry: PageGeometry | None = None
        self._buffers: list[tuple[int, int]] = []
        self._store: KVStore | None = None
        self._lock = threading.Lock()  # opening and closing the store
        self._next_open = 0.0
        self._closed = False
        self._last_warning = float("-inf")
        self._last_mismatch = float("-inf")
        self._warned_v2 = False
        self._open()  # early, so a misconfigured store shows in the start-up log

    # ---- store and host pool ----
    def _open(self) -> KVStore | None:
        if self._store is not None or self._closed:
            return self._store
        with self._lock:
            if self._store is None and not self._closed and time.monotonic() >= self._next_open:
                try:
                    store = open_store(self.settings.store)
                    for ptr, size in self._buffers:
                        self._register(store, ptr, size)
                    self._store = store
                except Exception as exc:  # any failure to open means "no L3 for now"
                    self._next_open = time.monotonic() + self.settings.reopen_interval_s
                    log.error("kvcentric store %r unavailable (%s); SGLang recomputes until "
                              "it is back", self.settings.store.name, exc)
        return self._store

    @staticmethod
    def _register(store: KVStore, ptr: int, size: int) -> None:
        try:
            code = store.register_buffer(ptr, size)
        except Exception as exc:  # an unregistered buffer only slows RDMA stores down
            code, detail = -1, str(exc)
        else:
            detail = f"code {code}"
        if code != OK:
            log.warning("kvcentric: registering %d B of host pool memory failed (%s)", size,
                        detail)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the host pool's page layout (keys depend on it) and register its memory."""
        super().register_mem_pool_host(mem_pool_host)
        try:
            geo = page_geometry(mem_pool_host, self.storage_config, self.model_id)
        except Exception as exc:  # an exotic pool: run without L3 rather than fail start-up
            log.error("kvcentric cannot store pages of this host pool (%s); L3 disabled", exc)
            self.geometry = None
            return
        bufs = getattr(mem_pool_host, "get_hybrid_pool_buffer", None)
        tensors = bufs() if callable(bufs) else [mem_pool_host.kv_buffer]
        seen: dict[int, int] = {}
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.numel():
                seen.setdefault(t.data_ptr(), t.numel() * t.element_size())
        with self._lock:
            old, self._buffers = self._buffers, list(seen.items())
            if self._store is not None:
                for ptr, _ in old:
                    try:
                        self._store.unregister_buffer(ptr)
                    except Exception as exc:
                        log.warning("kvcentric: unregistering a host buffer failed: %s", exc)
                for ptr, size in self._buffers:
                    self._register(self._store, ptr, size)
        self.geometry = geo
        log.info("kvcentric HiCache storage: %s pages of %d B (%d segments), keys %s*, %s",
                 geo.layout.layout, geo.object_bytes, geo.segments, geo.keyspace.prefix,
                 "writer" if geo.writer else "reader (another rank writes MLA KV)")

    def _ready(self) -> tuple[PageGeometry, KVStore] | None:
        geo = self.geometry
        store = self._open() if geo is not None else None
        return None if geo is None or store is None else (geo, store)

    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats.add(errors=1)
        now = time.monotonic()
        if now - self._last_warning > 10.0:  # at most one warning per 10 s, not per page
            self._last_warning = now
            log.warning("kvcentric %s failed (%s: %s); SGLang recomputes", what,
                        type(exc).__name__, exc)

    def _checked(self, loaded: Loaded) -> list[bool]:
        """Count (and log, at most once per 10 s) the objects that failed their header
        check; ``loaded.ok``."""
        if loaded.mismatched:
            self.stats.add(integrity_errors=len(loaded.mismatched))
            now = time.monotonic()
            if now - self._last_mismatch > 10.0:
                self._last_mismatch = now
                log.error("integrity: %d stored objects were written for another page, rank, "
                          "layout or format; read as misses, SGLang recomputes. First: %s",
                          len(loaded.mismatched), loaded.mismatched[0])
        return loaded.ok

    # ---- zero-copy v1 interface ----
    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, are stored."""
        ready = self._ready()
        if not keys or ready is None:
            return 0
        geo, store = ready
        try:
            hits = int(store.batch_exists(geo.keys(keys)))
        except Exception as exc:
            self._failed("lookup", exc)
            return 0
        self.stats.add(exists_pages=len(keys), exists_hits=hits)
        return hits

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Load pages ``keys`` into the host pool at ``host_indices`` (``page_size``
        indices per key); ``True`` per page loaded."""
        ready = self._ready()
        if not keys or ready is None:
            return [False] * len(keys)
        geo, store = ready
        t0 = time.perf_counter()
        try:
            ptrs = geo.page_ptrs(self.mem_pool_host, host_indices, len(keys))
            ok = self._checked(load_pages(store, geo, *geo.objects(keys), ptrs,
                                          self.settings.store.verify_checksums))
        except Exception as exc:
            self._failed("load", exc)
            return [False] * len(keys)
        dt, hits = time.perf_counter() - t0, sum(ok)
        self.stats.add(get_pages=len(keys), get_hits=hits, get_bytes=hits * geo.object_bytes,
                       get_seconds=dt)
        self.stats.record("prefetch", hits, hits * geo.object_bytes, dt)
        return ok

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store host-pool pages at ``host_indices`` under ``keys``; ``True`` per page
        stored or already present (or written by another rank, for MLA)."""
        geo = self.geometry
        if geo is not None and not geo.writer and keys:
            self.stats.add(set_pages=len(keys), set_skipped=len(keys))
            return [True] * len(keys)
        ready = self._ready()
        if not keys or ready is None:
            return [False] * len(keys)
        geo, store = ready
        t0 = time.perf_counter()
        try:
            ptrs = geo.page_ptrs(self.mem_pool_host, host_indices, len(keys))
            skeys, refs = geo.objects(keys)
            prefix = extra_info.prefix_keys if extra_info is not None else None
            ok = save_pages(store, geo, skeys, refs, ptrs, geo.parents(skeys, prefix))
        except Exception as exc:
            self._failed("store", exc)
            return [False] * len(keys)
        self._count_set(len(keys), sum(ok), sum(ok) * geo.object_bytes, t0)
        return ok

    def _count_set(self, pages: int, ok: int, nbytes: int, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.stats.add(set_pages=pages, set_ok=ok, set_failed=pages - ok, set_bytes=nbytes,
                       set_seconds=dt)
        self.stats.record("backup", ok, nbytes, dt)

    # ---- legacy interface (SGLang without interface_v1) ----
    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | bool | None:
        """Read ``key`` into ``target_location``: a contiguous CPU tensor (returned, or
        ``None`` when missing) or a pointer with ``target_sizes`` bytes (``True`` /
        ``False``)."""
        return self.batch_get([key], [target_location], [target_sizes])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        n = len(keys)
        locs = list(target_locations) if target_locations is not None else [None] * n
        sizes = list(target_sizes) if target_sizes is not None else [None] * n
        targets = [legacy_target(loc, sz, writable=True) for loc, sz in zip(locs, sizes)]
        miss: list[Any] = [False if isinstance(loc, int) else None for loc in locs]
        ready = self._ready()
        if ready is None or any(t is None for t in targets):
            return miss
        geo, store = ready
        tgt = [t for t in targets if t is not None]
        t0 = time.perf_counter()
        try:
            ok = self._checked(load_objects(store, geo, *geo.objects(keys), tgt,
                                            self.settings.store.verify_checksums))
        except Exception as exc:
            self._failed("load", exc)
            return miss
        out = [(t[2] if t[2] is not None else True) if o else m
               for t, o, m in zip(tgt, ok, miss)]
        self.stats.add(get_pages=n, get_hits=sum(ok), get_seconds=time.perf_counter() - t0,
                       get_bytes=sum(HEADER_BYTES + t[1] for t, o in zip(tgt, ok) if o))
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Store ``value`` (a CPU tensor) or ``target_sizes`` bytes at pointer
        ``target_location`` under ``key``."""
        return self.batch_set([key], [value], [target_location], [target_sizes])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store every page; ``True`` only when all are stored (or already present)."""
        n = len(keys)
        vals = list(values) if values is not None else [None] * n
        locs = list(target_locations) if target_locations is not None else [None] * n
        sizes = list(target_sizes) if target_sizes is not None else [None] * n
        geo = self.geometry
        if geo is not None and not geo.writer and n:
            self.stats.add(set_pages=n, set_skipped=n)
            return True
        targets = [legacy_target(v if v is not None else loc, sz, writable=False)
                   for v, loc, sz in zip(vals, locs, sizes)]
        ready = self._ready()
        if not n or ready is None or any(t is None for t in targets):
            return False
        geo, store = ready
        tgt = [t for t in targets if t is not None]
        t0 = time.perf_counter()
        try:
            skeys, refs = geo.objects(keys)
            ok = save_objects(store, geo, skeys, refs, tgt, geo.parents(skeys, None))
        except Exception as exc:
            self._failed("store", exc)
            return False
        self._count_set(n, sum(ok), sum(HEADER_BYTES + t[1] for t, o in zip(tgt, ok) if o), t0)
        return all(ok)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- v2 (hybrid models: Mamba / SWA / DSA side pools): not supported yet ----
    def _no_v2(self) -> None:
        if not self._warned_v2:
            self._warned_v2 = True
            log.warning("kvcentric does not store hybrid-model side pools (SGLang's v2 "
                        "storage interface) yet; those requests recompute")

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """Hybrid models: reported as misses."""
        self._no_v2()
        return PoolTransferResult.empty()

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        self._no_v2()
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        self._no_v2()
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    # ---- management ----
    def clear(self) -> bool:
        """Remove every object of this instance's key space (model, layout, rank), which
        other SGLang instances of the same model share; objects being read stay."""
        ready = self._ready()
        if ready is None:
            return False
        geo, store = ready
        if not geo.writer:
            return True  # the writing rank clears the shared MLA objects
        try:
            while keys := store.list_keys(geo.keyspace.prefix, 1000):
                if not sum(store.remove(k) == OK for k in keys):
                    break  # all leased by readers right now
        except Exception as exc:
            self._failed("clear", exc)
            return False
        return True

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call, with ``.kvcentric`` (counters)."""
        return self.stats.drain()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except Exception as exc:
                log.warning("kvcentric: closing the store failed: %s", exc)

