"""A benchmark told to stop (SIGTERM) stops what it started.

Benchmarks stop the engines, routers, emulators and stores they start in ``finally``
blocks and context managers. SIGTERM (``timeout``, a cancelled job) ends a Python process
without running them: a fleet run killed that way left its emulator, a router and its
store running, and the store's 4 GiB shared-memory arena on tmpfs, until the next
vLLM engine on the box was killed for memory. :func:`stop_on_sigterm` makes SIGTERM
raise ``SystemExit`` in the main thread, so the cleanup runs.
"""

from __future__ import annotations

import signal
from types import FrameType


def stop_on_sigterm() -> None:
    """From now on SIGTERM raises ``SystemExit(143)`` in the main thread; call from a
    benchmark's ``main`` before it starts anything."""
    signal.signal(signal.SIGTERM, _exit)


def _exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
