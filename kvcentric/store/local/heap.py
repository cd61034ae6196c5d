"""The coordinator's garbage collection: the index never costs a collection its size.

CPython's cyclic collector scans every tracked object of the generations it collects, and
it collects the oldest generation whenever the objects that reached it since the last time
are a quarter of those already there. The coordinator's index is made of long-lived
objects (an :class:`~kvcentric.store.local.index.Entry` and its list of children per stored
object): with the default policy a store under churn (puts evicting) runs a full
collection every time a quarter of its entries were replaced, and that collection stops
the coordinator's loop for time that grows with the number of stored objects. Every
client call waiting on it then waits too, and a call that overruns its bound opens the
engine's breaker.

:class:`FrozenHeap` moves what survived into CPython's permanent generation
(``gc.freeze()``) once a turn (at most every ``interval_s``), right after a collection of
everything younger: a collection then only ever scans what was allocated since the last
turn. Frozen objects are still freed by reference counting; what the permanent generation
gives up is collecting *cycles* among them. The index is free of cycles once an entry is
dropped (``ObjectIndex._drop`` unlinks it from its parent and its children), as are the
coordinator's per-client state and leases (tests/store/test_store_heap.py churns all three
and checks that the frozen count stays bounded).

Only the coordinator's process uses it (:meth:`Coordinator.serve`), never a process that
merely embeds a store client: freezing is process-wide.
"""

from __future__ import annotations

import gc
import time


class FrozenHeap:
    """The policy above; :meth:`turn` is called by the coordinator's loop every turn."""

    def __init__(self, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.interval_s = interval_s
        self._last = 0.0

    def start(self) -> None:
        """Freeze what the process holds once it is up (imports, config, the index)."""
        self._freeze(time.monotonic())

    def turn(self, now: float) -> None:
        """Collect the young generations and freeze the survivors, once per interval."""
        if now - self._last >= self.interval_s:
            self._freeze(now)

    def _freeze(self, now: float) -> None:
        gc.collect()  # scans only what is not frozen yet: the objects of the last interval
        gc.freeze()
        self._last = now

    @staticmethod
    def stats() -> dict[str, int]:
        """``gc_frozen``: objects in the permanent generation; ``gc_young``: tracked
        objects a collection would scan (cost: the young generations' size)."""
        return {"gc_frozen": gc.get_freeze_count(),
                "gc_young": sum(len(gc.get_objects(g)) for g in range(3))}
