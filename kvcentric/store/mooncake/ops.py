"""``ClientOps``: one Mooncake client and the bounded operations the backend's parts run on it.

:class:`~kvcentric.store.mooncake.store.MooncakeStore` (the ``KVStore`` semantics),
:class:`~kvcentric.store.mooncake.reads.LeaseReads` (read leases) and
:mod:`~kvcentric.store.mooncake.checksums` (sealed puts, checked gets) share one
:class:`ClientOps`, which the store makes and owns; none of them touches the Mooncake
client, the call runner, the breaker, the counters or the staging arena but through it.

Contract:

- **Client and breaker.** :attr:`ClientOps.client` is the live Mooncake client, or raises
  ``StoreUnavailable`` at once while the master is away, the breaker is open or the ops
  are closed. The :class:`~kvcentric.store.mooncake.health.MasterMonitor` joins in the
  background when the master was away at open and closes the breaker again (a probe,
  after every abandoned call has returned).
- **Bounded calls.** :meth:`ClientOps.call` runs ``fn(client)`` on the
  :class:`~kvcentric.store.mooncake.calls.CallRunner` within :meth:`ClientOps.bound_s` of
  its bytes (or an explicit ``timeout_s``); an overrun opens the breaker and raises
  ``CallTimeout``, the staging it names (``held``) stays held until Mooncake returns it.
  :meth:`ClientOps.get` and :meth:`ClientOps.put_raw` are bounded the same way when given
  ``held`` (staging), and wait for Mooncake when given ``None`` (caller memory, which no
  one could keep from reuse after an abandoned call).
- **Codes and counters.** Every Mooncake code goes through :meth:`ClientOps.mapped` (an
  unreachable code opens the breaker); :meth:`ClientOps.get` and :meth:`ClientOps.put_raw`
  count hits, misses, bytes and rejected puts, callers add the rest with
  :meth:`ClientOps.count` (thread-safe).
- **Staging.** :attr:`ClientOps.staging` is the registered arena, made on first use
  (needs the client); :meth:`ClientOps.free` gives extents back (nothing when no arena was
  ever made). The arena lives until :meth:`ClientOps.close`, or until exit when abandoned
  calls still run then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvcentric.config import StoreConfig
from kvcentric.store.base import ERR_NO_SPACE, ERR_NOT_FOUND, ERR_UNAVAILABLE, OK, StoreUnavailable
from kvcentric.store.mooncake.calls import CallRunner
from kvcentric.store.mooncake.client import join
from kvcentric.store.mooncake.codes import MC_NO_SPACE, map_code
from kvcentric.store.mooncake.config import MooncakeSettings
from kvcentric.store.mooncake.health import MasterMonitor
from kvcentric.store.mooncake.staging import StagingArena

if TYPE_CHECKING:
    from kvcentric.cuda.pinning import HostPinner

log = logging.getLogger("kvcentric.store")

_SENTINEL = "kvc/health/probe"
COUNTERS = ("hits", "misses", "puts", "put_bytes", "gets", "get_bytes", "rejected_puts",
            "skipped_puts", "corrupt")
# clients (and their staging) that abandoned calls still used at close: never destroyed
# under a running call (a crash); freed at exit
_LEAKED: list[tuple[Any, StagingArena | None]] = []


class ClientOps:
    """One Mooncake client with its breaker, bounded calls, counters and staging (see the
    module docstring for the contract). Made on the opening thread: the call threads run
    on that thread's cores (docs/connector.md §Worker side)."""

    def __init__(self, cfg: StoreConfig, settings: MooncakeSettings, protocol: str,
                 devices: str) -> None:
        self.cfg = cfg
        self.settings = settings
        self._protocol, self._devices = protocol, devices
        self._replicate: Any = None
        self._client: Any = None
        self._closed = False
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._registered: dict[int, int] = {}
        self._staging: StagingArena | None = None
        self._pinner: HostPinner | None = None
        self._calls = CallRunner("mooncake", self._timed_out, self._hold, self._unhold)
        host, port = settings.master_host_port
        self.monitor = MasterMonitor(host, port, self._probe, settings.probe_interval_s,
                                     settings.probe_timeout_s)
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
        client, self._replicate = join(self.settings, self._protocol, self._devices)
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

    # ---- the client, bounded ----
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

    @property
    def up(self) -> bool:
        """Open, joined, and the breaker closed."""
        return not self._closed and self._client is not None and self.monitor.up

    def bound_s(self, nbytes: int = 0) -> float:
        """How long a call moving ``nbytes`` may take before it is abandoned."""
        return self.cfg.hot_timeout_s + nbytes / self.cfg.min_transfer_rate

    def call(self, fn: Any, what: str, nbytes: int = 0, held: Sequence[int] = (),
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

    @property
    def abandoned(self) -> int:
        """Calls abandoned past their bound, ever."""
        return self._calls.abandoned

    @property
    def outstanding(self) -> int:
        """Abandoned calls that have not returned yet."""
        return self._calls.outstanding

    # ---- codes and counters ----
    def mapped(self, codes: Sequence[int]) -> list[int]:
        """Mooncake codes as ``KVStore`` codes; an unreachable one opens the breaker."""
        out = [map_code(int(c)) for c in codes]
        if ERR_UNAVAILABLE in out:
            self.monitor.mark_down(f"call returned {[c for c in codes if c < 0][:1]}")
        return out

    def count(self, **deltas: int) -> None:
        """Add to the named counters (:data:`COUNTERS`)."""
        with self._lock:
            for k, v in deltas.items():
                self._counters[k] += v

    def counters(self) -> dict[str, int]:
        """A snapshot of the counters."""
        with self._lock:
            return dict(self._counters)

    # ---- staging ----
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

    @property
    def made_staging(self) -> StagingArena | None:
        """The staging arena if it has been made (never makes it)."""
        return self._staging

    def free(self, ptrs: Sequence[int]) -> None:
        """Give staging objects back (held ones once their abandoned call returns)."""
        if self._staging is not None:
            self._staging.free(ptrs)

    def pin_host_memory(self, pinner: HostPinner) -> None:
        """Pins the staging arena now if it exists, else when it is made."""
        with self._lock:
            self._pinner = pinner
            if self._staging is not None:
                pinner.register(self._staging.base, self._staging.size)

    # ---- raw puts and gets ----
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

    def put_raw(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]],
                pin_s: float = 0.0, held: Sequence[int] | None = None) -> list[int]:
        """Put objects given as buffer lists (one buffer each: ``batch_put_from``) exactly
        as given, waiting up to ``no_space_wait_s`` for eviction when space runs out (the
        master evicts asynchronously past its high watermark); ``pin_s``: soft pin.
        ``held``: the staging objects the buffers are (each attempt bounded,
        :meth:`call`); ``None``: caller memory, each attempt waits for Mooncake. Per key
        a ``KVStore`` code; puts, their bytes and refusals are counted."""
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
                       self.call(put, "put", sum(sum(x) for x in n), held))
            except StoreUnavailable:
                break
            for i, c in zip(todo, self.mapped(raw)):
                out[i] = c
            todo = [i for i, c in zip(todo, raw) if c == MC_NO_SPACE]
            if not todo or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        ok = [i for i, c in enumerate(out) if c == OK]
        self.count(puts=len(ok), put_bytes=sum(sum(sizes[i]) for i in ok),
                   rejected_puts=out.count(ERR_NO_SPACE))
        return out

    def get(self, keys: Sequence[str], call: Any, nbytes: int = 0,
            held: Sequence[int] | None = None) -> list[int]:
        """``call(client)``'s per-key codes, mapped and counted (hits, gets, bytes,
        misses); ``ERR_UNAVAILABLE`` for every key when it cannot run or overran.
        ``held``: the staging it moves into (bounded by ``nbytes``, :meth:`call`);
        ``None``: caller memory (waits for Mooncake)."""
        if not keys:
            return []
        try:
            raw = call(self.client) if held is None else self.call(call, "get", nbytes, held)
        except StoreUnavailable:
            return [ERR_UNAVAILABLE] * len(keys)
        out = self.mapped(raw)
        got = [c for c in out if c >= 0]
        self.count(hits=len(got), gets=len(got), get_bytes=sum(got),
                   misses=out.count(ERR_NOT_FOUND))
        return out

    # ---- registration and lifetime ----
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

    def close(self) -> None:
        """Stop the monitor and the call threads; wait up to ``op_timeout_s`` for abandoned
        calls, then unregister and close the client (else leave it and its staging to
        exit: destroying them under a running call would crash)."""
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
