"""``MooncakeStore``: the ``mooncake`` backend, a client of a Mooncake Store cluster.

Wraps ``mooncake.store.MooncakeDistributedStore`` (``mooncake-transfer-engine``, the
``-non-cuda`` wheel on CPU). Objects live in segments processes lend to the pool
(``global_segment_size`` > 0, or ``kvcentric store mooncake-node``); ``mooncake_master``
indexes, allocates, evicts (asynchronously, at its high watermark) and leases reads.

Hot path, all batched, no Python ``bytes``: ``batch_is_exist``, ``batch_put_from`` (after
skipping stored keys), ``batch_get_into``; caller buffers are registered once
(:meth:`register_buffer`; unregistered sources bounce through Mooncake's local buffer,
~5x slower). :meth:`batch_alloc`/:meth:`batch_commit` write through extents of one
registered staging arena, so an object becomes visible whole; :meth:`batch_acquire` gets
objects into it until :meth:`release`, or (``ranged_reads``) :meth:`batch_acquire_streamed`
+ :meth:`fetch_range` stream them layer by layer (docs/store.md §Mooncake).
:meth:`batch_put_from_multi`/:meth:`batch_get_into_multi` gather/scatter over several
buffers. ``verify_checksums`` adds a checksum trailer to every object
(:mod:`kvcentric.store.mooncake.checksums`).

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
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvcentric.config import StoreConfig
from kvcentric.store.base import (
    ERR_HAS_LEASE,
    ERR_NO_SPACE,
    ERR_NOT_FOUND,
    ERR_UNAVAILABLE,
    OK,
    KVStore,
    ReadLease,
    StoreUnavailable,
    WriteSlot,
)
from kvcentric.store.mooncake.calls import CallRunner
from kvcentric.store.mooncake.checksums import get_checked, put_sealed
from kvcentric.store.mooncake.client import check_installed, chunks, join
from kvcentric.store.mooncake.codes import MC_NO_SPACE, map_code
from kvcentric.store.mooncake.config import (
    MooncakeSettings,
    engine_env,
    offload_bucket_problem,
)
from kvcentric.store.mooncake.health import MasterMonitor
from kvcentric.store.mooncake.http import fetch_keys, fetch_metrics
from kvcentric.store.mooncake.rdma import resolve_transport
from kvcentric.store.mooncake.reads import LeaseReads
from kvcentric.store.mooncake.staging import StagingArena

if TYPE_CHECKING:
    from kvcentric.cuda.pinning import HostPinner

log = logging.getLogger("kvcentric.store")

_SENTINEL = "kvc/health/probe"
# clients (and their staging) that abandoned calls still used at close: never destroyed
# under a running call (a crash); freed at exit
_LEAKED: list[tuple[Any, StagingArena | None]] = []


class MooncakeStore(KVStore):
    """One Mooncake client; see the module docstring for semantics and ownership."""

    def __init__(self, cfg: StoreConfig) -> None:
        self.cfg = cfg
        self.settings = s = MooncakeSettings.load(cfg.mooncake)
        self.protocol, self.devices = resolve_transport(s.protocol, s.device_name,
                                                        s.fallback_to_tcp)
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
        self._replicate: Any = None
        self._client: Any = None
        self._closed = False
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(("hits", "misses", "puts", "put_bytes", "gets",
                                        "get_bytes", "rejected_puts", "skipped_puts",
                                        "corrupt"), 0)
        self._registered: dict[int, int] = {}
        self._staging: StagingArena | None = None
        self._pinner: HostPinner | None = None
        self._reads = LeaseReads(self)
        # made on the opening thread: its threads run on that thread's cores
        # (docs/connector.md §Worker side)
        self._calls = CallRunner("mooncake", self._timed_out, self._hold, self._unhold)
        host, port = s.master_host_port
        self.monitor = MasterMonitor(host, port, self._probe, s.probe_interval_s,
                                     s.probe_timeout_s)
        if self.monitor.check_once():
            try:
                self._join()
            except StoreUnavailable as exc:  # a cache never stops its engine from starting
                self.monitor.mark_down(str(exc))
        # the monitor joins in the background once the master is up (and answers): calling
        # Mooncake's setup with the master away would block ~90 s
        self.monitor.start()

    def _join(self) -> None:
        """Create and set up the Mooncake client (blocks while Mooncake retries)."""
        client, self._replicate = join(self.settings, self.protocol, self.devices)
        for ptr, size in self._registered.items():  # asked for before the client existed
            client.register_buffer(ptr, size)
        self._client = client

    def _probe(self) -> bool:
        """Monitor thread, breaker open: join if never joined, else one bounded round trip,
        and only once every abandoned call has returned (the master or node it waited on
        has answered, so the path it took works again)."""
        if self._closed:
            return False
        if self._client is None:
            try:
                self._join()
            except StoreUnavailable as exc:
                log.warning("%s; retrying", exc)
                return False
            return True
        if self._calls.outstanding:
            return False
        client = self._client
        codes = self._calls.run(lambda: client.batch_is_exist([_SENTINEL]),
                                self.settings.probe_timeout_s, what="probe")
        return all(int(c) >= 0 for c in codes)

    # ---- bounds ----
    def bound_s(self, nbytes: int = 0) -> float:
        """How long a call moving ``nbytes`` may take before it is abandoned."""
        return self.cfg.hot_timeout_s + nbytes / self.cfg.min_transfer_rate

    def _call(self, fn: Any, what: str, nbytes: int = 0, held: Sequence[int] = (),
              timeout_s: float | None = None) -> Any:
        """``fn(client)`` within :meth:`bound_s` (or ``timeout_s``); ``held``: staging that
        ``fn`` reads or writes (kept from reuse if the call is abandoned). Raises
        ``StoreUnavailable`` at once while the breaker is open, ``CallTimeout`` on expiry."""
        client = self.client
        bound = self.bound_s(nbytes) if timeout_s is None else timeout_s
        return self._calls.run(lambda: fn(client), bound, held, what)

    def _timed_out(self, reason: str) -> None:
        self.monitor.mark_down(reason)

    def _hold(self, ptrs: Sequence[int]) -> None:
        if self._staging is not None:
            self._staging.hold(ptrs)

    def _unhold(self, ptrs: Sequence[int]) -> None:
        if self._staging is not None:
            self._staging.unhold(ptrs)

    # ---- plumbing ----
    @property
    def client(self) -> Any:
        """The live Mooncake client; raises ``StoreUnavailable`` while the master is away
        (callers answer ``ERR_UNAVAILABLE`` without a multi-second stall)."""
        if self._closed:
            raise StoreUnavailable("mooncake store is closed")
        if self._client is None or not self.monitor.up:
            raise StoreUnavailable(f"mooncake master {self.settings.master_server_address} "
                                   "is unreachable")
        return self._client

    def _mapped(self, codes: Sequence[int]) -> list[int]:
        out = [map_code(int(c)) for c in codes]
        if ERR_UNAVAILABLE in out:
            self.monitor.mark_down(f"call returned {[c for c in codes if c < 0][:1]}")
        return out

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counters[k] += v

    @property
    def staging(self) -> StagingArena:
        """The registered staging arena, made on first use (scheduler-only clients, which
        only ask ``batch_exists``, never pay for it)."""
        if self._staging is None:
            with self._lock:
                if self._staging is None:
                    staging = StagingArena(self.settings.staging_size,
                                           self.client.register_buffer)
                    if self._pinner is not None:
                        self._pinner.register(staging.base, staging.size)
                    self._staging = staging
        return self._staging

    def pin_host_memory(self, pinner: HostPinner) -> None:
        """Pins the staging arena (every slot and lease points into it), now if it
        exists, else when it is made."""
        with self._lock:
            self._pinner = pinner
            if self._staging is not None:
                pinner.register(self._staging.base, self._staging.size)

    def warm_up(self) -> None:
        try:
            self.staging  # noqa: B018 -- made (mapped, faulted, registered) on first use
        except (StoreUnavailable, RuntimeError) as exc:
            log.info("mooncake staging not prepared yet (%s); the first save makes it", exc)

    # ---- KVStore: existence, puts, gets ----
    def _exist_flags(self, keys: Sequence[str]) -> list[int]:
        """1/0 per key; raises ``StoreUnavailable`` when the master does not answer (in
        ``hot_timeout_s``)."""
        k = list(keys)
        codes = self._call(lambda c: c.batch_is_exist(k), "lookup")
        if any(int(c) < 0 for c in codes):
            self._mapped(codes)
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
        self._count(skipped_puts=len(keys) - len(todo))
        return out

    def _put(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]],
             pin_s: float = 0.0, held: Sequence[int] | None = None) -> list[int]:
        """Put objects given as buffer lists (one buffer: ``batch_put_from``), waiting a
        bounded time for eviction when space runs out (the master evicts asynchronously
        once past its high watermark); ``pin_s``: soft pin (:meth:`_config`). ``held``:
        the staging objects the buffers are (each attempt bounded, :meth:`_call`);
        ``None``: caller memory, each attempt waits for Mooncake."""
        if self.cfg.verify_checksums and keys:
            return put_sealed(self, keys, ptrs, sizes, pin_s, held)
        return self._put_raw(keys, ptrs, sizes, pin_s, held)

    def _config(self, pin_s: float) -> Any:
        """The ``ReplicateConfig`` of a put: soft-pinned for ``pin_s`` s when > 0 (the
        master evicts soft-pinned objects only after every unpinned one)."""
        if pin_s <= 0:
            return self._replicate
        from mooncake.store import ReplicateConfig, SoftPinAction

        cfg = ReplicateConfig()
        cfg.replica_num = self._replicate.replica_num
        cfg.preferred_segment = self._replicate.preferred_segment
        cfg.soft_pin_action = SoftPinAction.ENABLE
        cfg.soft_pin_ttl_ms = int(pin_s * 1000)
        return cfg

    def _put_raw(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]],
                 pin_s: float = 0.0, held: Sequence[int] | None = None) -> list[int]:
        out = [ERR_UNAVAILABLE] * len(keys)
        todo = list(range(len(keys)))
        deadline = time.monotonic() + self.settings.no_space_wait_s
        single = all(len(p) == 1 for p in ptrs)
        replicate = self._config(pin_s)
        while todo:
            k, p, n = [keys[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo]

            def put(c: Any, k: list[str] = k, p: list[list[int]] = p,
                    n: list[list[int]] = n) -> Any:
                return (c.batch_put_from(k, [x[0] for x in p], [x[0] for x in n], replicate)
                        if single else c.batch_put_from_multi_buffers(k, p, n, replicate))
            try:
                raw = (put(self.client) if held is None else
                       self._call(put, "put", sum(sum(x) for x in n), held))
            except StoreUnavailable:
                break
            for i, c in zip(todo, self._mapped(raw)):
                out[i] = c
            todo = [i for i, c in zip(todo, raw) if c == MC_NO_SPACE]
            if not todo or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        ok = [i for i, c in enumerate(out) if c == OK]
        self._count(puts=len(ok), put_bytes=sum(sum(sizes[i]) for i in ok),
                    rejected_puts=out.count(ERR_NO_SPACE))
        return out

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        _check_lengths(keys, ptrs, sizes)
        if self.cfg.verify_checksums:
            return get_checked(self, keys, [[p] for p in ptrs], [[n] for n in sizes])[0]
        return self._get(keys, lambda c: c.batch_get_into(list(keys), list(ptrs), list(sizes)))

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
                out += get_checked(self, k, p, n)[0]
                continue
            out += self._get(k, lambda m, k=k, p=p, n=n: m.batch_get_into_multi_buffers(k, p, n))
        return out

    def _get(self, keys: Sequence[str], call: Any, nbytes: int = 0,
             held: Sequence[int] | None = None) -> list[int]:
        """``call(client)``'s per-key codes, mapped and counted. ``held``: the staging it
        moves into (bounded, :meth:`_call`); ``None``: caller memory (waits for Mooncake)."""
        if not keys:
            return []
        try:
            raw = call(self.client) if held is None else self._call(call, "get", nbytes, held)
        except StoreUnavailable:
            return [ERR_UNAVAILABLE] * len(keys)
        out = self._mapped(raw)
        got = [c for c in out if c >= 0]
        self._count(hits=len(got), gets=len(got), get_bytes=sum(got),
                    misses=out.count(ERR_NOT_FOUND))
        return out

    def remove(self, key: str, force: bool = False) -> int:
        """Remove ``key``. Mooncake leases every object it hands out or writes (the master's
        ``--default_kv_lease_ttl``) because a reader may still be copying it; without
        ``force`` this waits (up to ``op_timeout_s``) for the lease to lapse, then answers
        ``ERR_HAS_LEASE``. ``force`` removes at once."""
        deadline = time.monotonic() + self.cfg.op_timeout_s
        while True:
            try:
                code = self._mapped([self._call(lambda c: c.remove(key, force), "remove",
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
        ptrs = self.staging.alloc_run([sizes[i] for i in todo])
        if len(ptrs) < len(todo):
            log.info("mooncake staging full: not saving %d of %d blocks", len(todo) - len(ptrs),
                     len(todo))
        out: list[WriteSlot | None] = [None] * len(keys)
        for i, p in zip(todo, ptrs):
            out[i] = WriteSlot(keys[i], p, int(sizes[i]), self)
        self._count(skipped_puts=len(keys) - len(todo))
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
        if self._staging is not None:
            self._staging.free([s.ptr for s in slots if s.handle is self])

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
        if ptr in self._registered:
            return OK
        if self._client is not None and not self._closed:
            rc = map_code(int(self._client.register_buffer(ptr, size)))
            if rc != OK:
                return rc
        self._registered[ptr] = size
        return OK

    def unregister_buffer(self, ptr: int) -> int:
        if self._registered.pop(ptr, None) is None or self._client is None or self._closed:
            return OK
        return map_code(int(self._client.unregister_buffer(ptr)))

    # ---- inspection ----
    def health_check(self) -> bool:
        return not self._closed and self._client is not None and self.monitor.up

    def master_metrics(self) -> dict[str, float]:
        """The master's label-free Prometheus values (``StoreUnavailable`` when its
        metrics endpoint does not answer)."""
        return fetch_metrics(self.settings.metrics_url, 2 * self.settings.probe_timeout_s)

    def stats(self) -> dict[str, Any]:
        """Cluster-wide bytes, keys and evictions from the master; the rest counts this
        client's calls."""
        m = self.master_metrics()
        with self._lock:
            counters = dict(self._counters)
        return {"backend": "mooncake", "used_bytes": int(m.get("master_allocated_bytes", 0)),
                "capacity_bytes": int(m.get("master_total_capacity_bytes", 0)),
                "keys": int(m.get("master_key_count", 0)),
                "evictions": int(m.get("master_evicted_key_count", 0)),
                "staging_used_bytes": self._staging.used if self._staging else 0,
                "staging_held_bytes": self._staging.held_bytes if self._staging else 0,
                "abandoned_calls": self._calls.abandoned,
                "abandoned_running": self._calls.outstanding,
                "master_up": self.monitor.up, "outages": self.monitor.outages, **counters}

    def list_keys(self, prefix: str = "", limit: int = 1000) -> list[str]:
        """Keys starting with ``prefix`` (the master's full key dump: inspection only)."""
        return [k for k in fetch_keys(self.settings.metrics_url) if k.startswith(prefix)][:limit]

    def clear(self, force: bool = True) -> int:
        """Remove every object (``force``: leased ones too); returns how many."""
        return int(self._call(lambda c: c.remove_all(force), "remove_all",
                              timeout_s=self.cfg.op_timeout_s))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.monitor.close()  # waits out a probe or join in flight
        self._calls.close()
        client, self._client = self._client, None
        if client is None:
            return
        if not self._calls.drain(self.cfg.op_timeout_s):
            log.warning("%d abandoned mooncake calls still running at close: their client "
                        "and staging stay until exit", self._calls.outstanding)
            _LEAKED.append((client, self._staging))
            self._staging = None
            return
        for ptr in list(self._registered):
            client.unregister_buffer(ptr)
        self._registered.clear()
        if self._staging is not None:
            client.unregister_buffer(self._staging.base)
            if self._pinner is not None:
                self._pinner.unregister(self._staging.base)
            self._staging.close()
            self._staging = None
        client.close()


def _check_lengths(keys: Sequence[str], ptrs: Sequence[Any], sizes: Sequence[Any]) -> None:
    if len(keys) != len(ptrs) or len(keys) != len(sizes):
        raise ValueError("keys, ptrs and sizes must have equal lengths")
