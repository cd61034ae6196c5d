"""Publishing a worker's written objects: inline, or on a commit thread.

Once a step's packs are done the objects' bytes are out of the KV cache, so nothing the
engine does next (frees, preemption, reuse of the pages) can touch them: with
``async_commit`` the commit (Mooncake: the transfer to the storage node) runs on a commit
thread and the step returns at once, at most :data:`MAX_PENDING_COMMITS` steps in flight.
A step that may end a saving request commits inline (``now``): its response must not
complete before its KV is in the store. A commit never raises: a failed one only means
those objects are not stored (aborted, never partly visible).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvcentric.connector.vllm.affinity import pin_to
from kvcentric.connector.vllm.counters import Counters
from kvcentric.store import KVStore, WriteSlot

log = logging.getLogger("kvcentric.connector")
MAX_PENDING_COMMITS = 4  # steps whose commits may be in flight before a step waits


class Committer:
    """Commits write slots for one worker (``pin_s``: soft-pin them, a P/D handoff)."""

    def __init__(self, store: KVStore, stats: Counters, pin_s: float, threaded: bool,
                 spare: Any = None) -> None:
        self.store, self.stats, self._pin_s = store, stats, pin_s
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvc-commit",
                                          initializer=pin_to, initargs=(spare,)) \
            if threaded else None
        self._pending: list[Future[None]] = []

    def commit(self, slots: list[WriteSlot], packed: Any = None, now: bool = False,
               stat: str = "saved_blocks") -> None:
        """Publish ``slots`` once ``packed`` (a CUDA event after their packs, or None) has
        passed: on the commit thread, or on this one (``now``, or no thread); ``stat``
        counts the objects stored."""
        self._pending = [f for f in self._pending if not f.done()]
        if self._thread is None or now:
            self._commit(slots, packed, stat)
            return
        if len(self._pending) >= MAX_PENDING_COMMITS:  # the store is slower than the steps
            self._pending.pop(0).result()
        self._pending.append(self._thread.submit(self._commit, slots, packed, stat))

    def _commit(self, slots: list[WriteSlot], packed: Any, stat: str) -> None:
        try:
            if packed is not None:
                packed.synchronize()
            t0 = time.perf_counter()
            try:
                codes = self.store.batch_commit(slots, self._pin_s)
            finally:
                self.stats.add(commit_seconds=time.perf_counter() - t0)
        except Exception as exc:
            log.error("committing %d objects failed: %s", len(slots), exc)
            self.store.batch_abort(slots)
            return
        ok = [s for s, c in zip(slots, codes, strict=False) if c == 0]
        self.stats.add(**{stat: len(ok)}, saved_bytes=sum(s.size for s in ok))

    def drain(self) -> None:
        """Wait for every pending commit (each store call is bounded; none raises)."""
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()

    def close(self) -> None:
        """Let pending commits land (before the store closes)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
