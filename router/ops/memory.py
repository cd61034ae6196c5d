"""Giving the heap the router freed back to the operating system.

Python hands blocks over 512 bytes (prompt text, token lists, JSON bodies) to glibc malloc.
glibc returns freed memory to the system only from the top of each arena; pages freed in
the middle stay resident. Under a steady request stream the router's live memory is bounded
(``cache.prompt_text_chars``), yet its RSS kept climbing: in the 64-engine soak
(``benchmarks/results/fleet_soak_64_probe_cache1m.json``) glibc's heap grew 6.7 MiB while
the bytes in use grew 1.1 MiB. ``malloc_trim(0)`` releases every free page of every arena
(``madvise(MADV_DONTNEED)``); :class:`HeapTrimmer` calls it every
``memory.trim_interval_s``. Off glibc (musl, macOS) there is nothing to call and
:attr:`HeapTrimmer.available` is false.

Each thread that allocates can also get an arena of its own (up to 8 per core), and an
arena's heap stays mapped: in the 30-minute soak with trimming
(``fleet_soak_64_probe_cache1m_trim.json``) one router's RSS stepped up 7 MiB when the
tokenising worker threads went from 9 to 11 while its bytes in use grew 2.8 MiB.
:func:`limit_arenas` caps them (``memory.malloc_arenas``, glibc's ``M_ARENA_MAX``).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
from collections.abc import Callable

log = logging.getLogger("kvcentric.router")

_MALLINFO = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
             "uordblks", "fordblks", "keepcost")
_M_ARENA_MAX = -8  # glibc's mallopt parameter
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO]


def _glibc() -> ctypes.CDLL | None:
    """glibc, when this process runs on it (``malloc_trim`` and ``mallinfo2``, 2.33+)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        libc.mallinfo2.restype = _MallInfo2
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def rss_bytes() -> int:
    """This process's resident set (``/proc/self/statm``); 0 where there is none."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def limit_arenas(n: int) -> bool:
    """Let glibc make at most ``n`` malloc arenas in this process from now on (threads
    beyond share them); process-wide, called once at the router's start before its worker
    threads exist. Returns whether it took effect (False off glibc)."""
    libc = _glibc()
    return libc is not None and libc.mallopt(_M_ARENA_MAX, n) == 1


def glibc_malloc() -> dict[str, float]:
    """glibc malloc over all arenas (MiB): ``heap`` obtained with brk/arenas, ``in_use``
    and ``free`` inside it, ``mmapped`` (large blocks); empty off glibc."""
    libc = _glibc()
    if libc is None:
        return {}
    m = libc.mallinfo2()
    mib = 1 / 2**20
    return {"glibc_heap_mib": round(m.arena * mib, 2),
            "glibc_in_use_mib": round(m.uordblks * mib, 2),
            "glibc_free_mib": round(m.fordblks * mib, 2),
            "glibc_mmapped_mib": round(m.hblkhd * mib, 2)}


class HeapTrimmer:
    """Calls ``malloc_trim(0)`` every ``interval_s`` seconds (:meth:`run`, a task of the
    router's lifespan). ``on_released`` gets the RSS each trim gave back, in bytes (the
    router counts it in ``kvc_router_heap_released_bytes``). The trim runs in a worker
    thread: on a heap of hundreds of MiB it takes milliseconds the event loop should not
    wait for, and glibc's arena locks make it safe beside the loop's own allocations."""

    def __init__(self, interval_s: float,
                 on_released: Callable[[int], None] | None = None) -> None:
        self.interval_s = interval_s
        self.on_released = on_released
        self._libc = _glibc()

    @property
    def available(self) -> bool:
        """Whether this process's allocator is glibc's (otherwise :meth:`trim` is a no-op)."""
        return self._libc is not None

    def trim(self) -> int:
        """Release every free heap page now; returns the RSS it gave back (bytes, >= 0)."""
        if self._libc is None:
            return 0
        before = rss_bytes()
        self._libc.malloc_trim(0)
        return max(0, before - rss_bytes())

    async def run(self) -> None:
        """Trim every ``interval_s`` until cancelled."""
        if self._libc is None:
            log.info("memory.trim_interval_s set but the allocator is not glibc's: not trimming")
            return
        while True:
            await asyncio.sleep(self.interval_s)
            released = await asyncio.to_thread(self.trim)
            if self.on_released is not None:
                self.on_released(released)
            log.debug("malloc_trim released %.1f MiB", released / 2**20)
