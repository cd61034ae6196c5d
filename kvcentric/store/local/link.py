"""A local-store client's link to its coordinator: the live session, the circuit breaker
and the background reconnector (docs/store.md §Local store).

Contract:

- **Hot calls never wait long and never connect.** :meth:`Link.hot` is one round trip on
  the live session, bounded by ``hot_timeout_s`` (plus the reserve hold-back the
  coordinator announces). With no live session, :meth:`Link.live` fails at once.
- **A failure opens the breaker.** A hot or administrative call that fails or times out
  kills its session (every lease and slot of it lapses: the connection is closed, so the
  coordinator reclaims them) and makes every call fail fast for ``reconnect_interval_s``;
  each failed reconnect doubles that, up to :data:`MAX_BACKOFF_S` (a coordinator that
  cannot start is not respawned every second by every engine).
- **Reconnects happen in the background.** A daemon thread reconnects once the breaker's
  interval has passed, retrying until it succeeds or the link is closed. Starting a
  coordinator (``autostart``) and mapping and prefaulting a new generation's arena happen
  there, never on a hot path (prefaulting releases the GIL: :mod:`.session`).
- **Administrative calls** (stats, keys, clear, remove) wait ``op_timeout_s`` and may
  connect inline, outside the breaker's interval: tools and tests call them, not engines'
  steps. Admin operations (clear, long pins) first present the coordinator's admin token,
  read from its ``0600`` file, once per session (:meth:`Link.authenticate`).
- **Generations.** The link keeps one reference on the current generation's arena, so a
  reconnect to the same coordinator maps and prefaults nothing; a new generation's hello,
  or finding no coordinator holding the store before starting one, lets the old mapping
  go (unmapped once no lease or slot uses it, so its tmpfs pages are freed).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from kvcentric.config import StoreConfig
from kvcentric.store.base import StoreUnavailable
from kvcentric.store.local import gate, launcher, ownership, session
from kvcentric.store.local.config import token_path
from kvcentric.store.local.session import Arena, Hello, Session

if TYPE_CHECKING:
    from kvcentric.cuda.pinning import HostPinner

log = logging.getLogger("kvcentric.store")
MIN_RETRY_S = 0.05  # the reconnector's pause between failed attempts at least
MAX_BACKOFF_S = 8.0  # the breaker's longest interval after repeated failed reconnects


class Link:
    """Sessions to ``cfg``'s coordinator, one live at a time (see the module docstring)."""

    def __init__(self, cfg: StoreConfig) -> None:
        self.cfg = cfg
        self.session: Session | None = None  # the live session; None while the breaker is open
        self.arena: Arena | None = None  # the current generation's mapping (our reference)
        self.pinner: HostPinner | None = None
        self._down_until = 0.0  # the breaker is open (calls fail fast) until then
        self._failures = 0  # failed connects since the last success
        self._state = threading.Lock()  # guards session, arena, _reconnector, _closed
        self._connecting = threading.Lock()  # one (re)connect at a time
        self._wake = threading.Event()  # set at close: the reconnector stops waiting
        self._reconnector: threading.Thread | None = None
        self._closed = False

    def connect(self) -> Session:
        """A live session: the current one, or a new connection (starting the coordinator
        if allowed, mapping a new generation's arena). Every failure is
        ``StoreUnavailable`` and keeps the breaker open for ``reconnect_interval_s``."""
        with self._connecting:
            s = self.session
            if s is not None:
                return s
            now = time.monotonic()
            if now < self._down_until:
                raise StoreUnavailable(f"store {self.cfg.name!r} unavailable; next reconnect "
                                       f"attempt in {self._down_until - now:.1f} s")
            try:
                if self.cfg.local.autostart:
                    self._forget_dead_generation()
                    launcher.ensure_running(self.cfg)
                rpc, hello = session.greet(self.cfg)
                try:
                    new = Session(rpc, self._arena_of(hello), session.open_index(
                        self.cfg, hello.raw.get("index"), hello.owner), hello,
                        self.cfg.hot_timeout_s)
                except BaseException:
                    rpc.close()
                    raise
            except (StoreUnavailable, OSError, ValueError, KeyError, TypeError) as exc:
                self._failures += 1
                self._open_breaker()
                if isinstance(exc, StoreUnavailable):
                    raise
                raise StoreUnavailable(f"cannot open store {self.cfg.name!r}: {exc}") from exc
            with self._state:
                if self._closed:
                    new.close()
                    raise StoreUnavailable(f"store {self.cfg.name!r} client is closed")
                self.session = new
                self._down_until = 0.0
                self._failures = 0
            return new

    def _forget_dead_generation(self) -> None:
        """Let our mapping go when no coordinator holds the store (its generation is dead):
        on a tmpfs sized for one arena, the next coordinator can reserve its own only
        once the dead one's pages are unmapped (leases still in use keep theirs)."""
        if self.arena is None or ownership.holder(self.cfg) is not None:
            return
        with self._state:
            old, self.arena = self.arena, None
        if old is not None:
            old.drop()

    def _arena_of(self, hello: Hello) -> Arena:
        """The mapping of the hello's generation: ours when it is the same coordinator;
        else the old one is let go (unmapped once no lease or slot uses it) and the new
        one mapped (and prefaulted) here, off the hot path."""
        arena = self.arena
        raw = hello.raw
        if arena is not None and arena.generation == raw["generation"]:
            return arena
        with self._state:
            old, self.arena = self.arena, None
        if old is not None:
            old.drop()
        arena = Arena(raw["arena"], int(raw["capacity"]), raw["generation"],
                      self.cfg.local.prefault, hello.owner)
        if self.pinner is not None:
            arena.pin(self.pinner)
        with self._state:
            if self._closed:
                arena.drop()
                raise StoreUnavailable(f"store {self.cfg.name!r} client is closed")
            self.arena = arena
        return arena

    def trip(self, s: Session, exc: Exception) -> None:
        """``s`` failed: it dies (its leases lapse), the breaker opens, the reconnector
        starts."""
        with self._state:
            if self.session is s:
                self.session = None
                self._open_breaker()
                log.warning("store %r unavailable (%s); recomputing, reconnecting in the "
                            "background in %.1f s", self.cfg.name, exc,
                            self.cfg.reconnect_interval_s)
        s.close()
        self.kick()

    def _open_breaker(self) -> None:
        interval = self.cfg.reconnect_interval_s
        backoff = interval * 2 ** min(max(self._failures - 1, 0), 16)
        self._down_until = time.monotonic() + min(backoff, max(interval, MAX_BACKOFF_S))

    def kick(self) -> None:
        """Make sure the background reconnector runs (a no-op while it does)."""
        with self._state:
            if self._closed or self._reconnector is not None:
                return
            self._reconnector = threading.Thread(target=self._reconnect_loop, daemon=True,
                                                 name=f"kvc-reconnect-{self.cfg.name}")
            self._reconnector.start()

    def _reconnect_loop(self) -> None:
        while True:
            with self._state:
                if self._closed or self.session is not None:
                    self._reconnector = None
                    return
            wait = self._down_until - time.monotonic()
            if wait > 0:
                self._wake.wait(wait)
                continue
            try:
                self.connect()
                log.info("store %r reachable again", self.cfg.name)
            except StoreUnavailable as exc:
                log.debug("store %r: reconnect failed: %s", self.cfg.name, exc)
                self._wake.wait(MIN_RETRY_S)
            except Exception:  # never let the thread die with the breaker open for good
                log.exception("store %r: reconnect failed", self.cfg.name)
                self._wake.wait(max(MIN_RETRY_S, self.cfg.reconnect_interval_s))

    def live(self) -> Session:
        """The live session, or ``StoreUnavailable`` at once (the breaker is open)."""
        s = self.session
        if s is None:
            self.kick()
            raise StoreUnavailable(f"store {self.cfg.name!r} unavailable (reconnecting)")
        return s

    def hot(self, s: Session, op: str, *args: Any) -> Any:
        """One hot-path round trip on ``s`` (``s.hot_timeout_s``); a failure trips ``s``."""
        try:
            return s.rpc.call(op, *args, timeout_s=s.hot_timeout_s)
        except StoreUnavailable as exc:
            self.trip(s, exc)
            raise

    def call(self, op: str, *args: Any) -> Any:
        """One administrative round trip (``op_timeout_s``), connecting inline if needed."""
        s = self.session or self.connect()
        try:
            return s.rpc.call(op, *args)
        except StoreUnavailable as exc:
            self.trip(s, exc)
            raise

    def authenticate(self, s: Session) -> None:
        """Present the admin token on ``s`` (once per session); ``StoreUnavailable`` when
        the token cannot be read (another user's store, a file not ours) or is refused."""
        if s.admin:
            return
        try:
            token = gate.read_token(self.cfg)
        except OSError as exc:
            raise StoreUnavailable(f"cannot read the admin token of store {self.cfg.name!r} "
                                   f"({token_path(self.cfg)}): {exc}") from exc
        try:
            s.rpc.call("auth", token)
        except StoreUnavailable as exc:
            self.trip(s, exc)
            raise
        except ValueError as exc:  # refused: the coordinator closes the connection too
            self.trip(s, exc)
            raise StoreUnavailable(str(exc)) from exc
        s.admin = True

    def admin_call(self, op: str, *args: Any) -> Any:
        """:meth:`call` on a session that presented the admin token."""
        s = self.session or self.connect()
        self.authenticate(s)
        try:
            return s.rpc.call(op, *args)
        except StoreUnavailable as exc:
            self.trip(s, exc)
            raise

    def pin(self, pinner: HostPinner) -> None:
        """Register the current arena with ``pinner``, and every later one."""
        self.pinner = pinner
        arena = self.arena
        if arena is not None:
            arena.pin(pinner)

    def close(self) -> None:
        """Close the live session and stop reconnecting (an attempt in flight closes what
        it opened). Mappings that leases or slots still use stay until those end."""
        with self._state:
            self._closed = True
            s, self.session = self.session, None
            arena, self.arena = self.arena, None
        self._wake.set()
        if s is not None:
            s.close()
        if arena is not None:
            arena.drop()
