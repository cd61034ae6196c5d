"""How fast the disk tier's file system reads cold data: the router's disk bandwidth.

:func:`cold_read` writes a scratch file under the tier's directory, drops its pages from
the page cache (``POSIX_FADV_DONTNEED`` after ``fdatasync``) and times a sequential read
of it in ``chunk``-sized ``preadv`` calls, the way the tier reads an object's layer
ranges. It also reports what fraction of the bytes this process really fetched from the
block device (``/proc/self/io`` ``read_bytes``): near 0 means the read never left memory
(tmpfs, or a file system that ignores the drop), so the number is not a disk's.

Used by ``kvcentric-router profile --disk-path`` (the cost model's ``T_load`` for
disk-only blocks) and by ``benchmarks/bench_tiers.py`` (the disk floor). The scratch file
is removed before returning, also on errors.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

CHUNK = 8 << 20


@dataclass(frozen=True)
class ColdRead:
    """Median ``seconds`` to read ``nbytes`` cold; ``device_fraction``: the smallest
    share of those bytes fetched from the block device over the repetitions."""

    nbytes: int
    seconds: float
    device_fraction: float

    @property
    def bandwidth_bps(self) -> float:
        return self.nbytes / self.seconds


def drop_pages(path: Path) -> None:
    """Evict ``path``'s clean pages from the page cache (its next read goes to the device)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def device_read_bytes(pid: int | str = "self") -> int:
    """Bytes process ``pid`` has caused to be fetched from block devices (``/proc/PID/io``);
    0 when the kernel does not account I/O."""
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def cold_read(where: Path, nbytes: int, chunk: int = CHUNK, reps: int = 3) -> ColdRead:
    """Time ``reps`` cold sequential reads of an ``nbytes`` scratch file in ``where``.
    ValueError on a bad size; OSError when ``where`` is not writable or has no room."""
    if nbytes <= 0 or chunk <= 0 or reps <= 0:
        raise ValueError("nbytes, chunk and reps must be > 0")
    path = Path(where) / f".kvc-probe-{uuid.uuid4().hex[:8]}.bin"
    buf = bytearray(os.urandom(min(nbytes, chunk)))
    times, fetched = [], []
    try:
        # a new file, never through a planted symlink: where may be a shared directory
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with open(fd, "wb") as f:
            for off in range(0, nbytes, len(buf)):
                f.write(memoryview(buf)[: min(len(buf), nbytes - off)])
            f.flush()
            os.fdatasync(f.fileno())
        view = memoryview(buf)
        for _ in range(reps):
            drop_pages(path)
            before = device_read_bytes()
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                t0 = time.perf_counter()
                for off in range(0, nbytes, len(buf)):
                    os.preadv(fd, [view[: min(len(buf), nbytes - off)]], off)
                times.append(time.perf_counter() - t0)
            finally:
                os.close(fd)
            fetched.append((device_read_bytes() - before) / nbytes)
    finally:
        path.unlink(missing_ok=True)
    return ColdRead(nbytes, statistics.median(times), min(fetched))
