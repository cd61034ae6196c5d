"""Registered staging memory for the Mooncake backend's in-place writes and reads.

Mooncake moves bytes only between *registered* buffers at full speed (an unregistered
source is bounced through the client's local buffer: ~5x slower puts, measured). The
connector's ``batch_alloc``/``batch_acquire`` hand out pointers, so the backend owns one
anonymous, prefaulted mapping, registers it once, and carves extents out of it.

Ownership: the arena owns the mapping; an extent belongs to the slot or lease it was
handed to until it is freed; the mapping is unmapped only by :meth:`StagingArena.close`.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvcentric.store.local.allocator import ExtentAllocator, align_up


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
        the arena when its last object is freed. Unknown pointers are ignored."""
        with self._lock:
            for p in ptrs:
                head = self._owner.pop(p, None)
                if head is None:
                    continue
                ext = self._extents[head]
                ext[1] -= 1
                if ext[1] == 0:
                    del self._extents[head]
                    self._alloc.free(head - self.base, ext[0])

    @property
    def used(self) -> int:
        return self._alloc.used

    def close(self) -> None:
        self._anchor = None
        try:
            self._mm.close()
        except BufferError:  # a view handed out is still alive; the GC unmaps it later
            pass
