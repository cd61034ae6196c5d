"""``MooncakeStore``: the ``mooncake`` backend, a client of a Mooncake Store cluster.

Wraps ``mooncake.store.MooncakeDistributedStore`` (``mooncake-transfer-engine``, the
``-non-cuda`` wheel on CPU). Objects live in segments processes lend to the pool
(``global_segment_size`` > 0, or ``kvcentric store mooncake-node``); ``mooncake_master``
indexes, allocates, evicts (asynchronously, at its high watermark) and leases reads.

Hot path, all batched, no Python ``bytes``: ``batch_is_exist``, ``batch_put_from`` (after
skipping stored keys), ``batch_get_into``; caller buffers are registered once
(:meth:`register_buffer`; unregistered sources bounce through Mooncake's local buffer,
a copy more). :meth:`batch_alloc`/:meth:`batch_commit` write through extents of one
registered staging arena, so an object becomes visible whole; :meth:`batch_acquire` gets
objects into it until :meth:`release`, or (``ranged_reads``) :meth:`batch_acquire_streamed`
+ :meth:`fetch_range` stream them layer by layer (docs/store.md §Mooncake).
:meth:`batch_put_from_multi`/:meth:`batch_get_into_multi` gather/scatter over several
buffers. ``verify_checksums`` adds a checksum trailer to every object
(:mod:`kvcentric.store.mooncake.checksums`). The Mooncake client itself, with its
breaker, bounded calls, counters and staging arena, is a
:class:`~kvcentric.store.mooncake.ops.ClientOps` that this store owns and hands to its
read leases and checksums (:attr:`MooncakeStore.ops`).

Errors map onto the ``KVStore`` codes (:mod:`kvcentric.store.mooncake.codes`). While the
master is unreachable calls answer ``ERR_UNAVAILABLE`` (or raise ``StoreUnavailable``) in
microseconds instead of Mooncake's ~4 s reconnect stall, and the client rejoins by itself
(:mod:`kvcentric.store.mooncake.health`). ``parents`` is ignored (Mooncake evicts by its own
policy, not leaves first).

Bounds (:mod:`kvcentric.store.mooncake.calls`): every call a step or a lookup waits on --
lookups, ``batch_alloc``, ``batch_commit``, ``batch_acquire[_streamed]``, ``fetch_range``,
``release`` -- returns within ``hot_timeout_s`` (a data call: plus its bytes at
``min_transfer_rate``, :meth:`MooncakeStore.bound_s`) even when the master or a storage
node hangs; an overrun call is abandoned (its staging is held until Mooncake returns it)
and opens the breaker. ``batch_put_from``/``batch_get_into`` and their ``_multi`` forms
move the *caller's* memory, which no one could keep from reuse after an abandoned call:
their lookups are bounded, their transfers wait for Mooncake (not for hot paths: the
connectors use slots and leases).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvcentric.config import StoreConfig
from kvcentric.store.base import (
    ERR_HAS_LEASE,
    ERR_UNAVAILABLE,
    OK,
    KVStore,
    ReadLease,
    StoreUnavailable,
    WriteSlot,
)
from kvcentric.store.mooncake.checksums import get_checked, put_sealed
from kvcentric.store.mooncake.client import check_installed, chunks
from kvcentric.store.mooncake.config import (
    engine_env,
    offload_bucket_problem,
)
from kvcentric.store.mooncake.http import fetch_keys, fetch_metrics
from kvcentric.store.mooncake.ops import ClientOps
from kvcentric.store.mooncake.rdma import resolve_transport
from kvcentric.store.mooncake.reads import LeaseReads

if TYPE_CHECKING:
    from kvcentric.cuda.pinning import HostPinner

log = logging.getLogger("kvcentric.store")


class MooncakeStore(KVStore):
    """One Mooncake client; see the module docstring for semantics and ownership."""

    def __init__(self, cfg: StoreConfig) -> None:
        self.cfg = cfg
        self.settings = s = cfg.mooncake
        protocol, devices = resolve_transport(s.protocol, s.device_name, s.fallback_to_tcp)
        missing = engine_env(s)
        if missing:
            raise ValueError(
                "Mooncake's transfer engine would bind its listener to a non-loopback "
                f"address; set {' '.join(f'{k}={v}' for k, v in missing.items())} in the "
                "environment before opening the store (kvcentric never writes os.environ)")
        problem = offload_bucket_problem(s)
        if problem:
            raise ValueError(problem)
        check_installed()
        # the client, its breaker, bounded calls, counters and staging (reads and checksums
        # use them only through this object, :mod:`kvcentric.store.mooncake.ops`)
        self.ops = ClientOps(cfg, s, protocol, devices)
        self._reads = LeaseReads(self.ops)

    def bound_s(self, nbytes: int = 0) -> float:
        """How long a call moving ``nbytes`` may take before it is abandoned."""
        return self.ops.bound_s(nbytes)

    def pin_host_memory(self, pinner: HostPinner) -> None:
        """Pins the staging arena (every slot and lease points into it), now if it
        exists, else when it is made."""
        self.ops.pin_host_memory(pinner)

    def warm_up(self) -> None:
        try:
            self.ops.staging  # noqa: B018 -- made (mapped, faulted, registered) on first use
        except (StoreUnavailable, RuntimeError) as exc:
            log.info("mooncake staging not prepared yet (%s); the first save makes it", exc)

    # ---- KVStore: existence, puts, gets ----
    def _exist_flags(self, keys: Sequence[str]) -> list[int]:
        """1/0 per key; raises ``StoreUnavailable`` when the master does not answer (in
        ``hot_timeout_s``)."""
        k = list(keys)
        codes = self.ops.call(lambda c: c.batch_is_exist(k), "lookup")
        if any(int(c) < 0 for c in codes):
            self.ops.mapped(codes)
            raise StoreUnavailable(f"batch_is_exist failed: {codes[:3]}")
        return [int(c) for c in codes]

    def batch_exists(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        try:
            flags = self._exist_flags(keys)
        except StoreUnavailable:
            return 0
        return next((i for i, f in enumerate(flags) if f != 1), len(flags))

    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
                       parents: Sequence[str | None] | None = None) -> list[int]:
        _check_lengths(keys, ptrs, sizes)
        return self._put_new(keys, [[p] for p in ptrs], [[s] for s in sizes])

    def batch_put_from_multi(self, keys: Sequence[str], ptr_lists: Sequence[Sequence[int]],
                             size_lists: Sequence[Sequence[int]]) -> list[int]:
        """Store ``keys[i]`` as the concatenation of the ``size_lists[i][j]`` bytes at
        ``ptr_lists[i][j]``: gather without a packing copy, e.g. an object's pages layer by
        layer straight from a registered paged KV cache. Keys already stored are skipped."""
        _check_lengths(keys, ptr_lists, size_lists)
        out: list[int] = []
        for c in chunks(ptr_lists):
            out += self._put_new(keys[c], ptr_lists[c], size_lists[c])
        return out

    def _put_new(self, keys: Sequence[str], ptr_lists: Sequence[Sequence[int]],
                 size_lists: Sequence[Sequence[int]]) -> list[int]:
        """Put the keys not yet stored (one ``batch_is_exist`` first); others are OK."""
        if not keys:
            return []
        try:
            flags = self._exist_flags(keys)
        except StoreUnavailable:
            return [ERR_UNAVAILABLE] * len(keys)
        todo = [i for i, f in enumerate(flags) if f != 1]
        out = [OK] * len(keys)
        codes = self._put([keys[i] for i in todo], [list(ptr_lists[i]) for i in todo],
                          [list(size_lists[i]) for i in todo])
        for i, c in zip(todo, codes):
            out[i] = c
        self.ops.count(skipped_puts=len(keys) - len(todo))
        return out

    def _put(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]],
             pin_s: float = 0.0, held: Sequence[int] | None = None) -> list[int]:
        """Put objects given as buffer lists, each with its checksum trailer under
        ``verify_checksums``; ``pin_s`` and ``held`` as :meth:`ClientOps.put_raw`."""
        if self.cfg.verify_checksums and keys:
            return put_sealed(self.ops, keys, ptrs, sizes, pin_s, held)
        return self.ops.put_raw(keys, ptrs, sizes, pin_s, held)

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        _check_lengths(keys, ptrs, sizes)
        if self.cfg.verify_checksums:
            return get_checked(self.ops, keys, [[p] for p in ptrs], [[n] for n in sizes])[0]
        return self.ops.get(keys, lambda c: c.batch_get_into(list(keys), list(ptrs), list(sizes)))

    def batch_get_into_multi(self, keys: Sequence[str], ptr_lists: Sequence[Sequence[int]],
                             size_lists: Sequence[Sequence[int]]) -> list[int]:
        """Scatter each object over its buffers (the inverse of
        :meth:`batch_put_from_multi`, e.g. straight into KV cache pages); returns the bytes
        read per key or a negative code."""
        _check_lengths(keys, ptr_lists, size_lists)
        out: list[int] = []
        for c in chunks(ptr_lists):
            k = list(keys[c])
            p = [list(x) for x in ptr_lists[c]]
            n = [list(x) for x in size_lists[c]]
            if self.cfg.verify_checksums:
                out += get_checked(self.ops, k, p, n)[0]
                continue
            out += self.ops.get(k, lambda m, k=k, p=p, n=n: m.batch_get_into_multi_buffers(k, p, n))
        return out

    def remove(self, key: str, force: bool = False) -> int:
        """Remove ``key``. Mooncake leases every object it hands out or writes (the master's
        ``--default_kv_lease_ttl``) because a reader may still be copying it; without
        ``force`` this waits (up to ``op_timeout_s``) for the lease to lapse, then answers
        ``ERR_HAS_LEASE``. ``force`` removes at once."""
        deadline = time.monotonic() + self.cfg.op_timeout_s
        while True:
            try:
                code = self.ops.mapped([self.ops.call(lambda c: c.remove(key, force),
                                                      "remove",
                                                      timeout_s=self.cfg.op_timeout_s)])[0]
            except StoreUnavailable:
                return ERR_UNAVAILABLE
            if code != ERR_HAS_LEASE or time.monotonic() >= deadline:
                return code
            time.sleep(0.05)

    # ---- in-place writes: staging extents, one batch_put_from at commit ----
    def batch_alloc(self, keys: Sequence[str], sizes: Sequence[int],
                    parents: Sequence[str | None] | None = None) -> list[WriteSlot | None]:
        """Slots for keys not yet stored (``None`` where the key exists, or the staging
        arena is full: that block is simply not saved). Raises ``StoreUnavailable``."""
        if len(keys) != len(sizes) or (parents is not None and len(parents) != len(keys)):
            raise ValueError("keys, sizes and parents must have equal lengths")
        if not keys:
            return []
        flags = self._exist_flags(keys)
        todo = [i for i, f in enumerate(flags) if f != 1]
        ptrs = self.ops.staging.alloc_run([sizes[i] for i in todo])
        if len(ptrs) < len(todo):
            log.info("mooncake staging full: not saving %d of %d blocks", len(todo) - len(ptrs),
                     len(todo))
        out: list[WriteSlot | None] = [None] * len(keys)
        for i, p in zip(todo, ptrs):
            out[i] = WriteSlot(keys[i], p, int(sizes[i]), self)
        self.ops.count(skipped_puts=len(keys) - len(todo))
        return out

    def batch_commit(self, slots: Sequence[WriteSlot], pin_s: float = 0.0) -> list[int]:
        if not slots:
            return []
        try:
            return self._put([s.key for s in slots], [[s.ptr] for s in slots],
                             [[s.size] for s in slots], pin_s, [s.ptr for s in slots])
        finally:
            self.batch_abort(slots)  # a slot an abandoned put still reads stays held

    def batch_abort(self, slots: Sequence[WriteSlot]) -> None:
        self.ops.free([s.ptr for s in slots if s.handle is self])

    # ---- in-place reads: get into staging, hand out pointers ----
    def batch_acquire(self, keys: Sequence[str], sizes: Sequence[int] | None = None) -> ReadLease:
        """Lease the leading run of present ``keys`` (as far as staging holds them);
        ``sizes`` bounds each object and is required. Raises ``StoreUnavailable``."""
        if sizes is None or len(sizes) != len(keys):
            raise ValueError("the mooncake backend needs one size bound per key")
        return self._reads.lease(keys, sizes, session=False)

    def batch_acquire_streamed(self, keys: Sequence[str], sizes: Sequence[int]) -> ReadLease:
        """With ``ranged_reads``: open a get session (the master resolves every replica
        once), reserve staging, move no bytes; :meth:`fetch_range` then gets one range of
        every object per call. Raises ``StoreUnavailable``."""
        if len(sizes) != len(keys):
            raise ValueError("the mooncake backend needs one size per key")
        return self._reads.lease(keys, sizes, session=self.settings.ranged_reads)

    def fetch_range(self, lease: ReadLease, offset: int, size: int) -> None:
        self._reads.fetch_range(lease, offset, size)

    def release(self, lease: ReadLease) -> None:
        self._reads.release(lease)

    # ---- registration ----
    def register_buffer(self, ptr: int, size: int) -> int:
        """Register caller memory once; before the client has joined its master the
        registration is remembered and made at join."""
        return self.ops.register_buffer(ptr, size)

    def unregister_buffer(self, ptr: int) -> int:
        return self.ops.unregister_buffer(ptr)

    # ---- inspection ----
    def health_check(self) -> bool:
        return self.ops.up

    def master_metrics(self) -> dict[str, float]:
        """The master's label-free Prometheus values (``StoreUnavailable`` when its
        metrics endpoint does not answer)."""
        return fetch_metrics(self.settings.metrics_url, 2 * self.settings.probe_timeout_s)

    def stats(self) -> dict[str, Any]:
        """Cluster-wide bytes, keys and evictions from the master; the rest counts this
        client's calls."""
        m = self.master_metrics()
        staging = self.ops.made_staging
        return {"backend": "mooncake", "used_bytes": int(m.get("master_allocated_bytes", 0)),
                "capacity_bytes": int(m.get("master_total_capacity_bytes", 0)),
                "keys": int(m.get("master_key_count", 0)),
                "evictions": int(m.get("master_evicted_key_count", 0)),
                "staging_used_bytes": staging.used if staging else 0,
                "staging_held_bytes": staging.held_bytes if staging else 0,
                "abandoned_calls": self.ops.abandoned,
                "abandoned_running": self.ops.outstanding,
                "master_up": self.ops.monitor.up, "outages": self.ops.monitor.outages,
                **self.ops.counters()}

    def list_keys(self, prefix: str = "", limit: int = 1000) -> list[str]:
        """Keys starting with ``prefix`` (the master's full key dump: inspection only)."""
        return [k for k in fetch_keys(self.settings.metrics_url) if k.startswith(prefix)][:limit]

    def clear(self, force: bool = True) -> int:
        """Remove every object (``force``: leased ones too); returns how many."""
        return int(self.ops.call(lambda c: c.remove_all(force), "remove_all",
                                 timeout_s=self.cfg.op_timeout_s))

    def close(self) -> None:
        self.ops.close()


def _check_lengths(keys: Sequence[str], ptrs: Sequence[Any], sizes: Sequence[Any]) -> None:
    if len(keys) != len(ptrs) or len(keys) != len(sizes):
        raise ValueError("keys, ptrs and sizes must have equal lengths")
