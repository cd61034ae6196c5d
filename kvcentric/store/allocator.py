"""First-fit extent allocator over a fixed-size arena, with coalescing of free extents.

Pure bookkeeping of offsets: it never touches the memory. Objects in one arena are usually
of one size (one KV layout), so a freed extent is normally reused as is; mixed sizes are
handled by coalescing neighbours.
"""

from __future__ import annotations

ALIGN = 64  # cache-line aligned objects keep memcpy on its fast path


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class ExtentAllocator:
    """Allocates ``[offset, offset+size)`` extents inside ``[0, capacity)``.

    Invariant: free extents never overlap or touch (touching ones are merged), and
    ``used + free == capacity``.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.used = 0
        self._free_by_start: dict[int, int] = {0: capacity}
        self._free_by_end: dict[int, int] = {capacity: 0}

    @staticmethod
    def footprint(size: int) -> int:
        """Bytes an object of ``size`` bytes takes in the arena."""
        return align_up(max(size, 1))

    def alloc(self, size: int) -> int | None:
        """Return the offset of a new extent of ``footprint(size)`` bytes, or None if full."""
        need = self.footprint(size)
        for start, length in self._free_by_start.items():
            if length >= need:
                self._take(start, length, need)
                self.used += need
                return start
        return None

    def _take(self, start: int, length: int, need: int) -> None:
        del self._free_by_start[start]
        del self._free_by_end[start + length]
        if length > need:
            self._free_by_start[start + need] = length - need
            self._free_by_end[start + length] = start + need

    def free(self, offset: int, size: int) -> None:
        """Return an extent given by ``alloc`` (same ``size``)."""
        length = self.footprint(size)
        self.used -= length
        start, end = offset, offset + length
        prev_start = self._free_by_end.pop(start, None)
        if prev_start is not None:
            del self._free_by_start[prev_start]
            start = prev_start
        next_len = self._free_by_start.pop(end, None)
        if next_len is not None:
            del self._free_by_end[end + next_len]
            end += next_len
        self._free_by_start[start] = end - start
        self._free_by_end[end] = start

    def largest_free(self) -> int:
        return max(self._free_by_start.values(), default=0)
