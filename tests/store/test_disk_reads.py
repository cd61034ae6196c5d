"""Client-side disk-tier reads (``store/local/disk_reads.py``) on real files: ranges queued on
the read pool land byte-exact, ``upto`` bounds what is read, torn files raise, corrupt ones
fail verification, ``close`` ends the lease only once no read can still write, and a hung
disk bounds every wait."""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcentric.store.base import checksum
from kvcentric.store.local.disk import DATA_OFFSET
from kvcentric.store.local.disk_reads import DiskReads
from kvcentric.store.local.wire import CORRUPT, PROMOTE

SIZE = 64 << 10  # an object of 4 "layers" of 16 KiB
LAYER = SIZE // 4


def payload(i: int) -> np.ndarray:
    return ((np.arange(SIZE, dtype=np.uint32) * 2654435761 + i) >> 7).astype(np.uint8)


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    paths = []
    for i in range(6):
        p = tmp_path / f"o{i}.kvc"
        p.write_bytes(bytes(DATA_OFFSET) + payload(i).tobytes())
        paths.append(p)
    return paths


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as p:
        yield p


def open_all(reads: DiskReads, files: list[Path]) -> list[np.ndarray]:
    """Open every file into private zeroed buffers; returns the buffers."""
    bufs = []
    for i, p in enumerate(files):
        buf = np.zeros(SIZE, np.uint8)
        data = payload(i)  # held while checksum reads it by address
        want = checksum(int(data.ctypes.data), SIZE)
        assert reads.open(i, str(p), SIZE, want, int(buf.ctypes.data)) == buf.ctypes.data
        bufs.append(buf)
    return bufs


def test_layer_ranges_arrive_exact_and_verify(files: list[Path],
                                              pool: ThreadPoolExecutor) -> None:
    reads = DiskReads(len(files), pool, 5.0)
    bufs = open_all(reads, files)
    for layer in range(4):
        assert not reads.verified()
        reads.fetch(layer * LAYER, LAYER)
        for i, buf in enumerate(bufs):  # this layer is in place when fetch returns
            assert np.array_equal(buf[: (layer + 1) * LAYER], payload(i)[: (layer + 1) * LAYER])
    assert reads.verified()
    assert reads.codes() == [PROMOTE] * len(files)
    reads.close()


def test_off_grid_ranges_are_read_too(files: list[Path], pool: ThreadPoolExecutor) -> None:
    reads = DiskReads(len(files), pool, 5.0)
    bufs = open_all(reads, files)
    reads.fetch(0, LAYER)
    reads.fetch(LAYER // 3, 3 * LAYER)  # overlaps queued ranges and the first one
    reads.fetch(LAYER // 3 + 3 * LAYER, SIZE)  # runs past the end: clipped
    for i, buf in enumerate(bufs):
        assert np.array_equal(buf, payload(i))
    assert reads.verified()
    reads.close()


def test_upto_reads_only_the_leading_objects(files: list[Path],
                                             pool: ThreadPoolExecutor) -> None:
    reads = DiskReads(len(files), pool, 5.0)
    bufs = open_all(reads, files)
    for layer in range(4):
        reads.fetch(layer * LAYER, LAYER, upto=2)
    assert reads.verified(2) and not reads.verified()
    reads.close()
    assert np.array_equal(bufs[1], payload(1))
    assert all(not buf.any() for buf in bufs[2:])  # never queued, never written


def test_a_torn_file_raises_and_a_corrupt_one_fails(files: list[Path],
                                                    pool: ThreadPoolExecutor) -> None:
    with open(files[1], "r+b") as f:
        f.seek(DATA_OFFSET + 100)
        f.write(b"\xff\x00\xff")
    files[3].write_bytes(files[3].read_bytes()[: DATA_OFFSET + LAYER + 10])
    reads = DiskReads(len(files), pool, 5.0)
    bufs = open_all(reads, files)  # reads write into them until close
    reads.fetch(0, LAYER)  # object 3 still has its first layer
    with pytest.raises(OSError) as exc:
        reads.fetch(LAYER, LAYER)
    assert exc.value.errno == errno.EIO
    reads.close()

    eager = DiskReads(len(files), pool, 5.0)
    bufs += open_all(eager, files)
    assert eager.fetch_all() == 1  # the first bad object ends the leading run
    assert eager.codes()[:2] == [PROMOTE, CORRUPT]
    eager.close()
    del bufs


class SlowPool(ThreadPoolExecutor):
    """Reads that take a while, counted as they start and finish."""

    def __init__(self) -> None:
        super().__init__(2)
        self.running = self.finished = 0
        self.lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kw: Any) -> Future[Any]:
        def slow() -> Any:
            with self.lock:
                self.running += 1
            try:
                time.sleep(0.02)  # not-sync: the slow disk read this pool models
                return fn(*args, **kw)
            finally:
                with self.lock:
                    self.running -= 1
                    self.finished += 1
        return super().submit(slow)


def test_close_waits_for_reads_in_flight(files: list[Path]) -> None:
    with SlowPool() as pool:
        reads = DiskReads(len(files), pool, 5.0)
        bufs = open_all(reads, files)
        reads.fetch(0, LAYER)  # the other 18 ranges are queued or running
        assert pool.finished < 4 * len(files)
        reads.close()
        assert pool.running == 0  # nothing can still write into the lease's memory
        del bufs
        assert pool.submit(lambda: 7).result() == 7  # cancelled reads left the pool usable


class HungPool(ThreadPoolExecutor):
    """A disk that stops answering: every read waits for ``gate`` before it reads."""

    def __init__(self) -> None:
        super().__init__(2)
        self.gate = threading.Event()
        self.running = 0
        self.lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kw: Any) -> Future[Any]:
        def hung() -> Any:
            with self.lock:
                self.running += 1
            try:
                self.gate.wait()
                return fn(*args, **kw)
            finally:
                with self.lock:
                    self.running -= 1
        return super().submit(hung)


def test_a_hung_disk_bounds_every_wait(files: list[Path]) -> None:
    """Reads that do not come back fail the fetch within the timeout, and ``close``
    returns within it too; the lease's end (``then``) waits for the stragglers, which
    write into its memory, and runs once they are done."""
    with HungPool() as pool:
        reads = DiskReads(len(files), pool, 0.2)
        bufs = open_all(reads, files)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            reads.fetch(0, LAYER)
        assert time.monotonic() - t0 < 1.0
        ended: list[list[int]] = []
        t0 = time.monotonic()
        assert reads.close(ended.append) is False  # two reads are stuck in the "disk"
        assert time.monotonic() - t0 < 1.0 and not ended and pool.running == 2
        pool.gate.set()
        deadline = time.monotonic() + 10
        while not ended and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ended and pool.running == 0  # ended only once nothing writes any more
        del bufs

    with HungPool() as pool:
        eager = DiskReads(len(files), pool, 0.2)
        bufs = open_all(eager, files)
        assert eager.fetch_all() == 0  # nothing arrived in time: an empty leading run
        assert eager.codes()[0] == 0  # a slow disk is not a corrupt file
        pool.gate.set()
        done: list[list[int]] = []
        eager.close(done.append)
        deadline = time.monotonic() + 10
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done and pool.running == 0
        del bufs
