"""Registered staging memory for the Mooncake backend's in-place writes and reads.

Mooncake moves bytes only between *registered* buffers at full speed (an unregistered
source is bounced through the client's local buffer, a copy more per put). The
connector's ``batch_alloc``/``batch_acquire`` hand out pointers, so the backend owns one
anonymous, prefaulted mapping, registers it once, and carves extents out of it.

Ownership: the arena owns the mapping; an extent belongs to the slot or lease it was
handed to until it is freed; the mapping is unmapped only by :meth:`StagingArena.close`.
An object that an abandoned Mooncake call may still read or write is *held*
(:meth:`StagingArena.hold`, :mod:`kvcentric.store.mooncake.calls`): freeing it then only
marks it, and it returns to the arena when the call has returned (:meth:`StagingArena.unhold`),
so no later slot or lease ever shares its bytes with that call.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvcentric.store.allocator import ExtentAllocator, align_up


class StagingArena:
    """``size`` bytes of registered memory, allocated in extents (thread-safe)."""

    def __init__(self, size: int, register: Callable[[int, int], int]) -> None:
        # MAP_POPULATE: fault every page in now, not inside a timed copy on the hot path
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        self._mm = mmap.mmap(-1, size, flags=flags)
        self._anchor: Any = ctypes.c_char.from_buffer(self._mm)
        self.base = ctypes.addressof(self._anchor)
        self.size = size
        self._alloc = ExtentAllocator(size)
        self._lock = threading.Lock()
        self._owner: dict[int, int] = {}  # object pointer -> its extent's first pointer
        self._extents: dict[int, list[int]] = {}  # extent head -> [bytes, live objects]
        self._held: dict[int, int] = {}  # object pointer -> abandoned calls using it
        self._freed_held: set[int] = set()  # freed by their owner while held
        rc = register(self.base, size)
        if rc != 0:
            self.close()
            raise RuntimeError(f"mooncake register_buffer of {size} B staging failed: {rc}")

    def alloc_run(self, sizes: Sequence[int]) -> list[int]:
        """Pointers for objects of ``sizes``, back to back in one extent when it fits (a
        constant stride lets the mover copy a whole batch per call), else one extent each.
        Returns fewer pointers than sizes when the arena is full (a leading prefix)."""
        if not sizes:
            return []
        strides = [align_up(s) for s in sizes]
        with self._lock:
            off = self._alloc.alloc(sum(strides))
            if off is not None:
                head = pos = self.base + off
                out = []
                for s in strides:
                    out.append(pos)
                    self._owner[pos] = head
                    pos += s
                self._extents[head] = [sum(strides), len(out)]
                return out
            singles = []
            for s in strides:
                one = self._alloc.alloc(s)
                if one is None:
                    break
                ptr = self.base + one
                singles.append(ptr)
                self._owner[ptr] = ptr
                self._extents[ptr] = [s, 1]
            return singles

    def free(self, ptrs: Sequence[int]) -> None:
        """Free objects by the pointers :meth:`alloc_run` returned; an extent returns to
        the arena when its last object is freed. Unknown pointers are ignored; a held one
        is freed when its last hold ends."""
        with self._lock:
            for p in ptrs:
                if p in self._held:
                    if p in self._owner:
                        self._freed_held.add(p)
                    continue
                self._release(p)

    def _release(self, p: int) -> None:
        head = self._owner.pop(p, None)
        if head is None:
            return
        ext = self._extents[head]
        ext[1] -= 1
        if ext[1] == 0:
            del self._extents[head]
            self._alloc.free(head - self.base, ext[0])

    def hold(self, ptrs: Sequence[int]) -> None:
        """Keep these objects from reuse (an abandoned call may still use them), even
        once freed, until as many :meth:`unhold` calls."""
        with self._lock:
            for p in ptrs:
                if p in self._owner:
                    self._held[p] = self._held.get(p, 0) + 1

    def unhold(self, ptrs: Sequence[int]) -> None:
        """End one hold of each object; one its owner freed meanwhile is freed now."""
        with self._lock:
            for p in ptrs:
                n = self._held.get(p, 0) - 1
                if n > 0:
                    self._held[p] = n
                    continue
                self._held.pop(p, None)
                if p in self._freed_held:
                    self._freed_held.discard(p)
                    self._release(p)

    @property
    def held(self) -> int:
        """Objects held for abandoned calls (freed by their owners or not)."""
        with self._lock:
            return len(self._held)

    @property
    def held_bytes(self) -> int:
        """Bytes of held objects, by the extents they were carved for (an object's share
        of a shared extent counts as its whole extent's stride: an upper bound)."""
        with self._lock:
            heads = {self._owner[p] for p in self._held if p in self._owner}
            return sum(self._extents[h][0] for h in heads)

    @property
    def used(self) -> int:
        return self._alloc.used

    def close(self) -> None:
        self._anchor = None
        try:
            self._mm.close()
        except BufferError:  # a view handed out is still alive; the GC unmaps it later
            pass
