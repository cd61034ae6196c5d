"""The disk tier's I/O threads: every disk write, unlink and recovery scan runs here.

The coordinator's loop only queues jobs and applies results, so no request waits on the
disk (docs/store.md §Disk tier). A job reads the object's bytes straight from the
coordinator's read-only mapping of the arena; the index pins those bytes until the job's
result is applied (the loop, woken through a pipe, applies results in order).

Writers run in parallel: a device with a queue takes several fdatasync'd writes at once
(fdatasync waits on the device, not the CPU, so parallel writers overlap). Each
thread takes at most its share of the queued writes as one batch, so one thread never
holds the whole queue while the others idle, and a batch's results (which free DRAM for
held-back writers) come back after a few writes, not after ``BATCH``.

Every path is resolved inside the tier's root without following a symlink
(:mod:`kvcentric.store.local.disk`), so no job reads, writes or deletes outside it; with a
seal key, files are sealed on write and recovery serves only files sealed under it.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcentric.store.local import disk

log = logging.getLogger("kvcentric.store")
BATCH = 16  # most writes one thread fsyncs together (directories once per batch)


@dataclass
class WriteJob:
    token: Any  # the index entry; only the loop thread reads or writes it
    key: str
    parent: str | None
    offset: int
    size: int
    path: Path


@dataclass
class WriteDone:
    token: Any
    ok: bool
    checksum: int = 0
    full: bool = False  # ENOSPC/EFBIG/EDQUOT: the tier is full, not broken
    error: str = ""
    path: Path | None = None


@dataclass
class Recovered:
    header: disk.Header
    path: Path


@dataclass
class RecoveryDone:
    files: int
    dropped: int  # torn or corrupt files deleted


class DiskWorker:
    """``threads`` I/O threads; results are collected with :meth:`results` after
    :attr:`wake_fd` became readable."""

    def __init__(self, arena_path: Path, capacity: int, root: Path, threads: int,
                 seal_key: bytes | None = None, gid: int | None = None) -> None:
        fd = os.open(arena_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self._mm = mmap.mmap(fd, capacity, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.root = root
        self.seal_key = seal_key
        self.gid = gid  # a peer_group's: its members' clients read the files
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._done: deque[Any] = deque()
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        self._threads = [threading.Thread(target=self._run, name=f"kvc-disk-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    # ---- loop side ----
    def submit(self, job: Any) -> None:
        self._jobs.put(job)

    def results(self) -> list[Any]:
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=30)
        os.close(self.wake_fd)
        os.close(self._wake_w)
        try:
            self._mm.close()
        except BufferError:
            pass

    # ---- I/O threads ----
    def _post(self, result: Any) -> None:
        self._done.append(result)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, WriteJob):
                self._write_batch([job, *self._more_writes()])
            elif isinstance(job, Path):
                self._remove(job)
            elif job == "recover":
                self._recover()

    def _more_writes(self) -> list[WriteJob]:
        """Queued writes to batch with the first, up to this thread's share of the queue;
        a non-write job is put back."""
        share = min(BATCH - 1, self._jobs.qsize() // len(self._threads))
        more: list[WriteJob] = []
        while len(more) < share:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if not isinstance(job, WriteJob):
                self._jobs.put(job)
                break
            more.append(job)
        return more

    def _write_batch(self, jobs: list[WriteJob]) -> None:
        done: list[WriteDone] = []
        dirs: set[str] = set()
        for job in jobs:
            try:
                view = memoryview(self._mm)[job.offset:job.offset + job.size]
                csum = disk.write_object(self.root, job.path, job.key, job.parent, view,
                                         self.seal_key, self.gid)
                dirs.add(job.path.parent.name)
                done.append(WriteDone(job.token, True, csum, path=job.path))
            except disk.ERRORS as exc:
                full = isinstance(exc, OSError) and exc.errno in disk.FULL_ERRNOS
                log.warning("disk tier: cannot write %s: %s", job.path, exc)
                done.append(WriteDone(job.token, False, full=full, error=str(exc)))
        for d in dirs:  # the renames are durable only once their directories are
            try:
                disk.fsync_dir(self.root, d)
            except disk.ERRORS as exc:
                log.warning("disk tier: cannot fsync %s: %s", self.root / d, exc)
        for r in done:
            self._post(r)

    def _remove(self, path: Path) -> None:
        try:
            disk.remove_object(self.root, path)
        except disk.ERRORS as exc:
            log.warning("disk tier: cannot remove %s: %s", path, exc)

    def _recover(self) -> None:
        files = dropped = 0
        try:
            for path in disk.scan(self.root):
                files += 1
                h = disk.read_header(self.root, path, self.seal_key)
                if h is None or not disk.names_key(path, h.key) \
                        or not disk.verify(self.root, path, h):
                    log.warning("disk tier: dropping torn, corrupt or unsealed file %s", path)
                    self._remove(path)
                    dropped += 1
                    continue
                self._post(Recovered(h, path))
        except disk.ERRORS as exc:  # the root was removed or swapped
            log.warning("disk tier: recovery scan of %s failed: %s", self.root, exc)
        self._post(RecoveryDone(files, dropped))
