"""A scratch directory on the disk the checkout lives on, for tests that measure reads that
reach a block device (the disk floor, the router's disk bandwidth).

pytest's ``tmp_path`` may sit on tmpfs (a CI runner's ``/tmp``), where no read reaches a
device and per-task I/O accounting counts nothing; the repository's own ``.bench-disk/``
(gitignored, what ``benchmarks.serving.tiers`` uses by default) is on the checkout's disk.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / ".bench-disk"


@contextmanager
def device_dir() -> Iterator[Path]:
    """A fresh directory under ``.bench-disk/``, removed with what it holds afterwards."""
    d = BASE / f"test-{uuid.uuid4().hex[:10]}"
    d.mkdir(parents=True)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
