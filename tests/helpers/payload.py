"""Deterministic object contents: any process can rebuild and check the bytes of a key."""

from __future__ import annotations

import numpy as np
import xxhash


def payload(key: str, size: int) -> np.ndarray:
    """``size`` pseudo-random bytes determined by ``key`` alone."""
    rng = np.random.default_rng(xxhash.xxh3_64_intdigest(key.encode()))
    return rng.integers(0, 256, size=size, dtype=np.uint8)


def size_of(key: str, lo: int = 64 << 10, hi: int = 256 << 10) -> int:
    """A key-determined object size in [lo, hi), 4 KiB granular."""
    span = (hi - lo) // 4096
    return lo + (xxhash.xxh3_64_intdigest(key.encode() + b"#") % span) * 4096
