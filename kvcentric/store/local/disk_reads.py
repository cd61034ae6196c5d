"""Client side of disk-tier reads: a lease's disk-resident objects, read from their files.

The coordinator leases a disk-only object with its file and, when DRAM had room, an arena
extent to read it into (docs/store.md §Disk tier). The client reads each requested byte
range with ``os.preadv`` straight into that extent (or into private memory), so a streamed
lease moves one layer's bytes per ``fetch_range`` and nothing is copied twice. Bytes read
from disk count as data only once the whole object is read and matches the checksum its
writer stored in the file: :meth:`DiskReads.verified` (the connector's end-of-step
``lease_valid``) checks it, and a mismatch is a lapsed lease (the engine recomputes). At
release, :meth:`DiskReads.codes` tells the coordinator which objects to promote to DRAM and
which files were corrupt or missing.

Reads run on a small thread pool owned by the client (:data:`READ_THREADS`): the first
``fetch`` of a lease queues every range of every object, range by range (range k of every
object before range k + 1), and each ``fetch`` waits for its own ranges only, so the device
works on later layers while the copy thread unpacks earlier ones. Kernel readahead is off
for these files (``POSIX_FADV_RANDOM``): on its own it reads the rest of each file behind
the first range asked for, and the first layer waited for all of them; the pool's
range-ordered reads hand the first layer its bytes first, while the whole lease takes
about as long either way.

Every wait is bounded by ``timeout_s`` (``LocalSettings.disk_read_timeout_s``): a read that
does not finish in time fails its fetch (the lease is then incomplete, the engine
recomputes), and :meth:`DiskReads.close` does not wait past it either: it hands the end
of the lease (its settle, its memory) to the last straggling read, so the memory a read
still writes into is never given back before that read ends.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field

import numpy as np

from kvcentric.store.base import StoreUnavailable, checksum
from kvcentric.store.local.disk import DATA_OFFSET
from kvcentric.store.local.wire import CORRUPT, MISSING, PROMOTE

READ_THREADS = 8  # enough to keep a device's queue full; more threads only add contention


@dataclass
class _DiskObject:
    index: int  # position in the lease
    fd: int
    ptr: int
    size: int
    checksum: int
    promote: bool  # ptr is an arena extent the coordinator may publish
    keep: object = None  # private memory behind ptr
    spans: list[tuple[int, int]] = field(default_factory=list)  # fetched [start, end), merged
    state: int = 0  # 0 unknown, PROMOTE verified good, CORRUPT, MISSING

    def add_span(self, start: int, end: int) -> None:
        spans = sorted([*self.spans, (start, end)])
        merged = [spans[0]]
        for s, e in spans[1:]:
            if s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((s, e))
        self.spans = merged

    def has(self, start: int, end: int) -> bool:
        return any(s <= start and end <= e for s, e in self.spans)

    @property
    def complete(self) -> bool:
        return self.spans == [(0, self.size)]


class DiskReads:
    """The disk-resident objects of one lease. One thread at a time (the lease's) calls
    its methods; ``pool`` threads only read into the objects' memory, and :meth:`close`
    ends the lease once they are done."""

    def __init__(self, n: int, pool: Executor, timeout_s: float,
                 opener: Callable[[str], int] | None = None) -> None:
        self.objects: list[_DiskObject] = []
        # the client's opener resolves a file inside its tier without following a symlink
        # (kvcentric.store.local.disk.open_object); by default: the path, O_NOFOLLOW
        self._opener = opener or _open
        self.codes_ = [0] * n  # per lease position; filled for failures and verifications
        self.timeout_s = timeout_s
        self._pool = pool
        self._jobs: list[tuple[_DiskObject, int, int, Future[None]]] = []
        self._queued = False

    def _queue(self, offset: int, stride: int, upto: int | None) -> None:
        """Queue reads of every object (of the first ``upto`` positions) from ``offset``
        on in ``stride``-byte ranges, range-major. Done once, by the first fetch."""
        if self._queued:
            return
        self._queued = True
        objs = [o for o in self.objects if upto is None or o.index < upto]
        for start in range(offset, max((o.size for o in objs), default=0), stride):
            for obj in objs:
                end = min(start + stride, obj.size)
                if start < end:
                    fut = self._pool.submit(_pread_into, obj.fd, obj.ptr + start, end - start,
                                            DATA_OFFSET + start)
                    self._jobs.append((obj, start, end, fut))

    def open(self, i: int, path: str, size: int, csum: int, ptr: int | None) -> int | None:
        """Open object ``i``'s file; returns where its bytes will be, or None (and a MISSING
        code) when the file is gone."""
        try:
            fd = self._opener(path)
        except (OSError, StoreUnavailable):  # gone, or refused (a symlink, not ours)
            self.codes_[i] = MISSING
            return None
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # see the module docstring
        except OSError:
            pass  # a hint
        keep = None
        if ptr is None:
            keep = np.empty(size, np.uint8)  # no DRAM room to promote into: private memory
            ptr = int(keep.ctypes.data)
        self.objects.append(_DiskObject(i, fd, ptr, size, csum, keep is None, keep))
        return ptr

    def fetch(self, offset: int, size: int, upto: int | None = None) -> None:
        """Read bytes ``[offset, offset + size)`` of every object (of the first ``upto``
        lease positions); ``OSError`` on an I/O error, a file shorter than its header
        says (torn or truncated under us), or reads not done within ``timeout_s``
        (``TimeoutError``)."""
        deadline = time.monotonic() + self.timeout_s
        self._queue(offset, size, upto)
        end_ = offset + size
        for obj, start, end, fut in self._jobs:
            if start < end_ and offset < end and (upto is None or obj.index < upto):
                fut.result(max(0.0, deadline - time.monotonic()))
                obj.add_span(start, end)
        for obj in self.objects:  # whatever the queued ranges did not cover: read it now
            if upto is not None and obj.index >= upto:
                break
            start, end = min(offset, obj.size), min(end_, obj.size)
            if start < end and not obj.has(start, end):
                fut = self._pool.submit(_pread_into, obj.fd, obj.ptr + start, end - start,
                                        DATA_OFFSET + start)
                self._jobs.append((obj, start, end, fut))
                fut.result(max(0.0, deadline - time.monotonic()))
                obj.add_span(start, end)

    def fetch_all(self) -> int:
        """Read every object whole and verify it; returns the lease position of the first
        object that failed (the lease's leading run ends there), or -1."""
        deadline = time.monotonic() + self.timeout_s
        self._queue(0, max((o.size for o in self.objects), default=1), None)
        for obj, _, _, fut in self._jobs:
            try:
                fut.result(max(0.0, deadline - time.monotonic()))
                obj.add_span(0, obj.size)
            except TimeoutError:
                return obj.index  # a slow disk, not a bad file: nothing to report
            except OSError:
                self.codes_[obj.index] = CORRUPT
            if not self._check(obj):
                return obj.index
        return -1

    def _check(self, obj: _DiskObject) -> bool:
        if obj.state == 0 and obj.complete and self.codes_[obj.index] == 0:
            good = checksum(obj.ptr, obj.size) == obj.checksum
            obj.state = PROMOTE if good else CORRUPT
            self.codes_[obj.index] = (PROMOTE if obj.promote else 0) if good else CORRUPT
        return obj.state == PROMOTE

    def verified(self, upto: int | None = None) -> bool:
        """True when every object (of the first ``upto`` positions) was read whole and
        matches its checksum."""
        return all(self._check(obj) for obj in self.objects
                   if upto is None or obj.index < upto)

    def codes(self) -> list[int]:
        """Per lease position: PROMOTE, CORRUPT, MISSING or 0 (nothing to report)."""
        for obj in self.objects:
            self._check(obj)
        return self.codes_

    def close(self, then: Callable[[list[int]], None] | None = None) -> bool:
        """End the lease's reads, then call ``then(codes())`` (if given): queued reads are
        cancelled; running ones write into memory the lease is about to give back, so
        ``then`` runs only once they are done. Waits ``timeout_s`` at most: True when
        ``then`` ran here, False when the last straggling read will run it (on a pool
        thread)."""
        for *_, fut in self._jobs:
            fut.cancel()
        _, pending = wait([fut for *_, fut in self._jobs], self.timeout_s)
        if not pending:
            self._finish(then)
            return True
        left, lock = [len(pending)], threading.Lock()

        def one_done(_: Future[None]) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._finish(then)

        for fut in pending:
            fut.add_done_callback(one_done)
        return False

    def _finish(self, then: Callable[[list[int]], None] | None) -> None:
        codes = self.codes()
        self._jobs = []
        for obj in self.objects:
            try:
                # the tier must not shadow DRAM in the page cache (docs/store.md §Disk tier)
                os.posix_fadvise(obj.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            os.close(obj.fd)
        self.objects = []
        if then is not None:
            then(codes)


def _open(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _pread_into(fd: int, ptr: int, size: int, pos: int) -> None:
    view = memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")
    while view:
        n = os.preadv(fd, [view], pos)
        if n == 0:
            raise OSError(errno.EIO, "disk-tier file is shorter than its object (torn)")
        view, pos = view[n:], pos + n
