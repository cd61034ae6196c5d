"""Master liveness for the Mooncake backend: fail fast while the master is away.

Measured with the 0.3.13 wheel: once ``mooncake_master`` is gone, *every* client call
(``batch_is_exist``, ``batch_get_into``, ``batch_put_from``) blocks ~4.3 s in a reconnect
attempt before returning ``RPC_FAIL``, and the client's own ``health_check()`` keeps
answering 0 (healthy). An engine calling the store on every step would stall for seconds
per step. So a :class:`MasterMonitor` thread watches the master (a TCP connect to its RPC
port every ``interval``; when that fails, or a call returns an unreachable code, the
master is *down*), and while it is down the store answers ``ERR_UNAVAILABLE`` at once
without calling Mooncake. When the port accepts again, one real Mooncake call (``probe``)
must succeed before the master counts as *up*: that call also makes the client reconnect
and remount its segment on the restarted master.

The same state is the store's circuit breaker for hung peers: a master or storage node
that is stopped (SIGSTOP, a stalled host) still accepts connections, so nothing fails, the
calls just block. A call that overruns its bound (:mod:`kvcentric.store.mooncake.calls`)
marks the store down; the probe then waits until every abandoned call has returned (the
peer it waited on answered) before its round trip may close the breaker again.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvcentric.store")


def tcp_accepts(host: str, port: int, timeout: float) -> bool:
    """True when ``host:port`` accepts a TCP connection within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class MasterMonitor:
    """Up/down state of one master, kept by a daemon thread started by :meth:`start`.

    ``probe()`` is a real client round trip returning True on success; it runs only on
    the monitor thread and only while the master is down.
    """

    def __init__(self, host: str, port: int, probe: Callable[[], bool], interval: float,
                 timeout: float) -> None:
        self.host, self.port = host, port
        self._probe = probe
        self.interval, self.timeout = interval, timeout
        self._up = threading.Event()
        self._up.set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.down_since: float | None = None
        self.outages = 0

    @property
    def up(self) -> bool:
        return self._up.is_set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvc-mooncake-health",
                                        daemon=True)
        self._thread.start()

    def mark_down(self, reason: str) -> None:
        """Open the breaker (idempotent); calls fail fast until the master is back."""
        if self._up.is_set():
            self._up.clear()
            self.down_since = time.monotonic()
            self.outages += 1
            log.warning("mooncake store (master %s:%d) unavailable (%s): store calls fail "
                        "fast, engines recompute", self.host, self.port, reason)

    def _mark_up(self) -> None:
        since = self.down_since or time.monotonic()
        self.down_since = None
        self._up.set()
        log.warning("mooncake store (master %s:%d) is back after %.1f s", self.host,
                    self.port, time.monotonic() - since)

    def check_once(self) -> bool:
        """One monitor step; returns the state after it."""
        if not tcp_accepts(self.host, self.port, self.timeout):
            self.mark_down("RPC port closed")
        elif not self.up:
            try:
                ok = self._probe()
            except Exception as exc:  # a probe must never kill the monitor thread
                log.debug("mooncake probe raised %s", exc)
                ok = False
            if ok:
                self._mark_up()
        return self.up

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.check_once()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; waits for a probe in flight (the client must outlive it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
