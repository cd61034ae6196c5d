"""Revision digests of model and adapter directories: what makes KV of new weights differ.

A served name says nothing about the weights behind it: replace a model's (or a LoRA
adapter's) files and keep its name, and a store keyed by name alone would hand the old
weights' KV to the new ones. So the key space folds in a *revision* digest of the files
on disk (:class:`kvcentric.stored_layout.KVLayout`), and LoRA blocks chain their
adapter's digest (:mod:`kvcentric.connector.vllm.extra_keys`).

The digest reads, for every weight or config file directly in the directory (sorted by
name): its name, its size, and xxh3 of its first and last :data:`SAMPLE_BYTES` (JSON and
other small files whole). Fine-tuned weights of the same shapes differ in every sample;
reading a few MiB per file keeps start-up fast on models of hundreds of GiB. A directory
that cannot be read has no revision (``""``); the caller decides what that means.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import xxhash

SAMPLE_BYTES = 1 << 20
_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model", ".txt")


def _file_digest(path: Path, size: int, h: xxhash.xxh3_128) -> None:
    with open(path, "rb", buffering=0) as f:
        if size <= 2 * SAMPLE_BYTES:
            h.update(f.read())
            return
        h.update(f.read(SAMPLE_BYTES))
        f.seek(size - SAMPLE_BYTES)
        h.update(f.read(SAMPLE_BYTES))


def _listing(directory: Path) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of the files the digest reads, sorted by name."""
    out = []
    with os.scandir(directory) as it:
        for entry in it:
            if entry.is_file() and entry.name.endswith(_SUFFIXES):
                st = entry.stat()
                out.append((entry.name, st.st_size, st.st_mtime_ns))
    return sorted(out)


def directory_revision(directory: str | Path) -> str:
    """32 hex chars naming the weights and configs in ``directory``; ``""`` when it is
    not a readable directory or holds none of them."""
    d = Path(directory)
    try:
        files = _listing(d)
        if not files:
            return ""
        h = xxhash.xxh3_128()
        for name, size, _ in files:
            h.update(f"{name}\0{size}\0".encode())
            _file_digest(d / name, size, h)
        return h.hexdigest()
    except OSError:
        return ""


class RevisionCache:
    """:func:`directory_revision` per directory, recomputed only when a file's size or
    mtime changes (one ``scandir`` per call). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[str, tuple[list[tuple[str, int, int]], str]] = {}

    def get(self, directory: str) -> str:
        try:
            files = _listing(Path(directory))
        except OSError:
            return ""
        with self._lock:
            hit = self._known.get(directory)
        if hit is not None and hit[0] == files:
            return hit[1]
        rev = directory_revision(directory)
        with self._lock:
            self._known[directory] = (files, rev)
        return rev
