"""Bounded calls into Mooncake's client: a call that overruns its deadline is abandoned,
never waited for (docs/store.md §Mooncake, "Bounds").

Mooncake's C++ client blocks while its master or a storage node does not answer (a
SIGSTOPped process: its ports still accept, so nothing fails), and a blocked call cannot
be interrupted. So every call that a forward pass or a scheduler step may wait on runs on a
thread of a :class:`CallRunner`, and the caller waits at most its bound.

Contract of :meth:`CallRunner.run`:

- **Bounded.** It returns the call's result (or raises its exception) when the call ends
  within ``timeout_s``; otherwise it raises :class:`CallTimeout` (a ``StoreUnavailable``)
  within ``timeout_s`` plus a thread wake-up, and calls ``on_timeout`` (the store opens its
  circuit breaker there).
- **Abandoned calls are safe.** A call that never started is cancelled (it touched
  nothing). One that started keeps running on its thread until Mooncake returns; the
  memory it may still read or write (``held``) is handed to ``hold`` before ``run`` raises
  and to ``unhold`` once the call returns, so the caller may free it at once: the owner
  (the staging arena) keeps it out of use until then. Such a call counts in
  :attr:`CallRunner.outstanding` while it runs and in :attr:`CallRunner.abandoned` for
  good.
- **Abandoned calls yield the CPU.** Mooncake's TCP transfer polls while it waits for a
  stopped node: each call blocked on a SIGSTOPped storage node keeps a core
  busy, which on a small CPU host slows the very forward pass that gave up on it. So an
  abandoned call's thread drops to ``SCHED_IDLE`` (else nice 19): it runs only on cores
  nothing else wants. An unprivileged thread cannot climb back, so that thread ends when
  its call returns, and a fresh one takes its place.
- **Threads.** Calls run on daemon threads started on the opening thread's cores (the
  vLLM worker opens its store on its spare cores, docs/connector.md §Worker side); a
  thread stuck in an abandoned call is replaced, up to :data:`MAX_THREADS`, after which
  new calls wait in the queue (and time out there, cancelled).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvcentric.store.base import StoreUnavailable

log = logging.getLogger("kvcentric.store")
MAX_THREADS = 16  # stuck threads beyond this would mean the breaker failed to open
_QUEUED, _RUNNING, _DONE, _CANCELLED, _ABANDONED = range(5)


class CallTimeout(StoreUnavailable):
    """A Mooncake call overran its bound and was abandoned (it may still be running)."""


class _Call:
    """One call and its fate; ``lock`` orders the caller's give-up against the return."""

    __slots__ = ("fn", "lock", "done", "state", "result", "error", "held", "tid")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.state = _QUEUED
        self.result: Any = None
        self.error: BaseException | None = None
        self.held: Sequence[int] = ()
        self.tid = 0  # the native id of the thread running it


class CallRunner:
    """Runs calls with deadlines on a small pool of threads (see the module docstring)."""

    def __init__(self, name: str, on_timeout: Callable[[str], None],
                 hold: Callable[[Sequence[int]], None] | None = None,
                 unhold: Callable[[Sequence[int]], None] | None = None,
                 threads: int = 2) -> None:
        self.name = name
        self._on_timeout = on_timeout
        self._hold, self._unhold = hold, unhold
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._busy = 0  # calls queued or running
        self.outstanding = 0  # abandoned calls that have not returned yet
        self.abandoned = 0  # abandoned calls, ever
        self._closed = False
        try:
            self._cpus: set[int] | None = os.sched_getaffinity(0)
        except (AttributeError, OSError):
            self._cpus = None
        for _ in range(threads):
            self._spawn()

    def _spawn(self) -> None:
        self._threads += 1
        threading.Thread(target=self._loop, name=f"kvc-{self.name}-{self._threads}",
                         daemon=True).start()

    def _loop(self) -> None:
        if self._cpus is not None:  # a replacement starts from whoever made the call
            try:
                os.sched_setaffinity(0, self._cpus)
            except OSError:
                pass
        while True:
            call = self._queue.get()
            if call is None:
                return
            late = self._execute(call)
            with self._lock:
                self._busy -= 1
                if late:  # this thread was demoted: a fresh one serves the next calls
                    self._threads -= 1
                    return

    def _execute(self, call: _Call) -> bool:
        """Run ``call``; True when it had been abandoned (and so this thread demoted)."""
        with call.lock:
            if call.state == _CANCELLED:
                return False
            call.state = _RUNNING
            call.tid = threading.get_native_id()
        try:
            call.result = call.fn()
        except BaseException as exc:  # handed to the caller, or logged if it left
            call.error = exc
        with call.lock:
            late = call.state == _ABANDONED
            call.state = _DONE
            call.done.set()
        if late:
            self._returned(call)
        return late

    def _returned(self, call: _Call) -> None:
        """An abandoned call came back: its memory may be reused, the breaker may close."""
        if call.held and self._unhold is not None:
            self._unhold(call.held)
        with self._lock:
            self.outstanding -= 1
        log.info("an abandoned mooncake call returned (%s)",
                 "ok" if call.error is None else f"{type(call.error).__name__}: {call.error}")

    def run(self, fn: Callable[[], Any], timeout_s: float, held: Sequence[int] = (),
            what: str = "call") -> Any:
        """``fn()`` within ``timeout_s`` or :class:`CallTimeout`; ``held``: memory ``fn``
        reads or writes, kept from reuse while an abandoned ``fn`` runs."""
        if self._closed:
            raise StoreUnavailable("mooncake store is closed")
        call = _Call(fn)
        with self._lock:
            self._busy += 1
            if self._busy > self._threads and self._threads < MAX_THREADS:
                self._spawn()  # every thread is busy (some may be stuck): one more
        self._queue.put(call)
        if not call.done.wait(timeout_s):
            with call.lock:
                gave_up = call.state != _DONE  # it may have returned just now
                if call.state == _QUEUED:
                    call.state = _CANCELLED  # never started: it touches nothing
                elif call.state == _RUNNING:
                    call.state = _ABANDONED
                    _demote(call.tid)
                    call.held = tuple(held)
                    if call.held and self._hold is not None:
                        self._hold(call.held)  # before the caller can free it
                    with self._lock:
                        self.outstanding += 1
                        self.abandoned += 1
            if gave_up:
                reason = f"{what} took over {timeout_s * 1000:.0f} ms"
                self._on_timeout(reason)
                raise CallTimeout(f"mooncake {reason}; abandoned")
        if call.error is not None:
            raise call.error
        return call.result

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for abandoned calls to return; True when none runs."""
        deadline = time.monotonic() + timeout_s
        while self.outstanding and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.outstanding == 0

    def close(self) -> None:
        """Stop the idle threads (a thread in an abandoned call ends after it returns)."""
        self._closed = True
        for _ in range(self._threads):
            self._queue.put(None)


def _demote(tid: int) -> None:
    """Let thread ``tid`` run only on otherwise idle cores (best effort)."""
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except (AttributeError, OSError):
        pass
