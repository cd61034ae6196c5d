"""Where the connector's own threads run on a CPU engine: off the compute cores.

vLLM's CPU worker pins its process to the cores its OpenMP compute threads use (with
``VLLM_CPU_NUM_OF_RESERVED_CPU``, the others are left to the API server and the engine
core). Every thread the worker creates inherits that mask, so without care our copy
and commit threads, and a Mooncake client's transfer threads, would take turns with the
forward pass on the compute cores, while the cores vLLM reserved for others idle through
the forward. Threads started through :func:`spare_thread`
(or a pool whose initializer is :func:`pin_to_spare`) run on the other cores instead.
On a GPU worker nothing is pinned and these are no-ops.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("kvcentric.connector")
CGROUP_CPUS = Path("/sys/fs/cgroup/cpuset.cpus.effective")


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,6"`` -> {0, 1, 2, 3, 6}; ``ValueError`` on anything else."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def machine_cpus() -> set[int]:
    """The CPUs this container may use at all (its cgroup cpuset, else all CPUs)."""
    try:
        cpus = parse_cpu_list(CGROUP_CPUS.read_text())
        if cpus:
            return cpus
    except (OSError, ValueError):
        pass
    return set(range(os.cpu_count() or 1))


def spare_cpus() -> set[int] | None:
    """CPUs the calling thread is not pinned to, or None when it is not pinned (or no
    CPU is left over): then threads keep the affinity they inherit."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    mine = os.sched_getaffinity(0)
    rest = machine_cpus() - mine
    return rest or None


def pin_to(cpus: set[int] | None) -> None:
    """Move the calling thread onto ``cpus`` (no-op for None; a refusal is logged)."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        log.warning("cannot move a kvcentric thread to CPUs %s: %s", sorted(cpus), exc)


def spare_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` to completion on a short-lived thread pinned to the spare CPUs
    (so threads it starts inherit them) and return its result or raise its exception."""
    cpus = spare_cpus()
    if cpus is None:
        return fn(*args)
    box: dict[str, Any] = {}

    def run() -> None:
        pin_to(cpus)
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run, name="kvc-spare", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")
