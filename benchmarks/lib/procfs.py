"""What ``/proc`` says about the processes a benchmark started (Linux only).

Used by the soaks (memory and descriptors per process, and their growth per 1000
requests: :func:`slope`), the router-overhead benchmark (CPU time per request) and the
tier benchmark (bytes an engine really read from the
block device, to tell an SSD read from a page-cache hit).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcentric import disk_probe


def group_pids(pgid: int) -> list[int]:
    """Every live process in process group ``pgid`` (an engine and its children)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    out.append(int(entry))
            except OSError:
                continue
    return out


def usage(pids: list[int]) -> tuple[float, int]:
    """(RSS MiB, open fds) summed over ``pids``."""
    rss, fds = 0.0, 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) / 1024
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
    return rss, fds


def cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid``'s live threads, in nanoseconds' resolution
    (``/proc/PID/task/TID/schedstat``; ``/proc/PID/stat`` counts 10 ms clock ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def group_cpu_seconds(pgids: Sequence[int]) -> float:
    """CPU seconds of every live process in the process groups ``pgids``."""
    total = 0.0
    for pgid in pgids:
        for pid in group_pids(pgid):
            try:
                total += cpu_seconds(pid)
            except (FileNotFoundError, ProcessLookupError):
                pass  # a process that ended meanwhile
    return total


def pin_group(pgid: int, cpus: set[int]) -> None:
    """Bind every thread of every live process in process group ``pgid`` to ``cpus``;
    the threads and processes they make later inherit it."""
    for pid in group_pids(pgid):
        try:
            tasks = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # a process that ended meanwhile
        for tid in tasks:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:
                pass  # a thread that ended meanwhile


def quiesce(pgids: Sequence[int], window_s: float = 0.1, busy_share: float = 0.05,
            timeout_s: float = 5.0) -> float:
    """Wait until the process groups ``pgids`` together use less than ``busy_share`` of
    one CPU over a ``window_s`` window, or ``timeout_s`` has passed; returns the seconds
    waited. An engine keeps a core busy for about a second after each request (vLLM's
    worker polls for its next step); engines of different arms on the same cores would
    otherwise time each other's polling, not their own work."""
    t0 = time.perf_counter()
    last = group_cpu_seconds(pgids)
    while time.perf_counter() - t0 < timeout_s:
        time.sleep(window_s)
        now = group_cpu_seconds(pgids)
        if now - last < busy_share * window_s:
            break
        last = now
    return time.perf_counter() - t0


def device_read_bytes(pids: list[int]) -> int:
    """Bytes ``pids`` caused to be fetched from the storage layer (``/proc/PID/io``
    ``read_bytes``): page-cache hits do not count, so a read that found its pages cached
    adds nothing here."""
    return sum(disk_probe.device_read_bytes(pid) for pid in pids)


def slope(samples: list[dict[str, Any]], key: str, since: float) -> float:
    """Least-squares MiB per 1000 requests of ``key`` once ``since`` (a fraction) of the
    requests were served."""
    last = samples[-1]["requests"]
    pts = [(s["requests"], s[key]) for s in samples if s["requests"] >= since * last]
    if len(pts) < 3:
        return float("nan")
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    var = sum((x - mx) ** 2 for x, _ in pts)
    return 1000 * sum((x - mx) * (y - my) for x, y in pts) / var if var else float("nan")
