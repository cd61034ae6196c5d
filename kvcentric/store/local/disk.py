"""The disk tier's files: one file per object, self-describing, written atomically.

Layout of ``{dir}/{h[:2]}/{h}-{tag}.kvc`` (``h`` = xxh3_128 hex of the key; §4.5 of
docs/architecture.md):

- bytes ``[0, DATA_OFFSET)``: the header: ``MAGIC``, the payload size, the payload's xxh3_64,
  the key and the parent key (UTF-8), then the xxh3_64 of all of that; zero padding.
- bytes ``[DATA_OFFSET, DATA_OFFSET + size)``: the object, byte for byte as in DRAM, so a
  reader's byte range ``[a, b)`` of the object is file range ``[DATA_OFFSET + a, …)``.

A file is written under a ``.tmp`` name, ``fdatasync``ed, renamed into place and its directory
fsynced, so a final name only ever holds a complete object (a crash leaves at most a
``.tmp``, which recovery deletes). Corruption after that (bit rot, a file truncated or
overwritten under us) is caught by the payload checksum: recovery checks every file before
publishing it, and every reader checks the bytes it read before they count as data.

Page cache, not ``O_DIRECT`` (measured in §4.5): readers fetch one layer's range at a time into
arena slots that are 64-byte aligned, which ``O_DIRECT`` cannot address without a bounce
copy, and the kernel's readahead makes buffered layer-sized reads faster. Writers and readers
drop the pages they touched (``POSIX_FADV_DONTNEED``) so the tier does not shadow DRAM in
the page cache and a later read goes to the device.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

MAGIC = b"KVCDISK1"
DATA_OFFSET = 4096  # page-aligned payload: readahead and any future O_DIRECT reader agree
_FIXED = struct.Struct("<8sQQII")  # magic, size, payload xxh3_64, key length, parent length
_SEAL = struct.Struct("<Q")
SUFFIX = ".kvc"
TMP = ".tmp"
# errors that mean "the tier is full" rather than "the tier is broken"
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
CHUNK = 8 << 20


@dataclass(frozen=True)
class Header:
    key: str
    parent: str | None
    size: int
    checksum: int


def object_path(root: Path, key: str, tag: str) -> Path:
    """Where ``key``'s file goes. ``tag`` is unique per write (coordinator id + counter): two
    lives of one key never share a name, so a late unlink of the old can't hit the new."""
    h = xxhash.xxh3_128_hexdigest(key.encode())
    return root / h[:2] / f"{h}-{tag}{SUFFIX}"


def names_key(path: Path, key: str) -> bool:
    """True when ``path`` is a file name :func:`object_path` gives ``key``."""
    h = xxhash.xxh3_128_hexdigest(key.encode())
    return path.parent.name == h[:2] and path.name.startswith(h + "-")


def footprint(size: int) -> int:
    """Bytes an object of ``size`` bytes takes on disk (the capacity bound counts these)."""
    return DATA_OFFSET + (size + 4095) // 4096 * 4096


def encode_header(key: str, parent: str | None, size: int, checksum: int) -> bytes:
    k, p = key.encode(), (parent or "").encode()
    body = _FIXED.pack(MAGIC, size, checksum, len(k), len(p)) + k + p
    if len(body) + _SEAL.size > DATA_OFFSET:
        raise ValueError(f"key too long for the disk tier: {key[:64]!r}")
    body += _SEAL.pack(xxhash.xxh3_64_intdigest(body))
    return body + bytes(DATA_OFFSET - len(body))


def decode_header(raw: bytes) -> Header | None:
    """The header in ``raw`` (a file's first ``DATA_OFFSET`` bytes), or None if torn."""
    if len(raw) < _FIXED.size:
        return None
    magic, size, csum, klen, plen = _FIXED.unpack_from(raw)
    end = _FIXED.size + klen + plen
    if magic != MAGIC or end + _SEAL.size > len(raw):
        return None
    (seal,) = _SEAL.unpack_from(raw, end)
    if seal != xxhash.xxh3_64_intdigest(raw[:end]):
        return None
    key = raw[_FIXED.size:_FIXED.size + klen].decode()
    parent = raw[_FIXED.size + klen:end].decode() or None
    return Header(key, parent, size, csum)


def write_object(path: Path, key: str, parent: str | None, data: memoryview) -> int:
    """Write ``data`` as ``path`` (tmp + fdatasync + rename); returns its checksum.
    The caller fsyncs ``path.parent`` (batched over many objects). Raises ``OSError``."""
    csum = xxhash.xxh3_64_intdigest(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + TMP)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, encode_header(key, parent, len(data), csum))
        _write_all(fd, data)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except BaseException:
        os.close(fd)
        _unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)
    return csum


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: Path | str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_object(path: Path | str) -> None:
    _unlink(path)


def read_header(path: Path) -> Header | None:
    """The file's header if the file is whole (header sealed, length right); else None."""
    try:
        with open(path, "rb") as f:
            h = decode_header(f.read(DATA_OFFSET))
            size = os.fstat(f.fileno()).st_size
    except (OSError, UnicodeDecodeError):
        return None
    if h is None or size != DATA_OFFSET + h.size:
        return None
    return h


def verify(path: Path, h: Header) -> bool:
    """True when the file's payload has ``h.size`` bytes with checksum ``h.checksum``."""
    hasher = xxhash.xxh3_64()
    got = 0
    try:
        with open(path, "rb", buffering=0) as f:
            f.seek(DATA_OFFSET)
            while chunk := f.read(CHUNK):
                hasher.update(chunk)
                got += len(chunk)
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    return got == h.size and hasher.intdigest() == h.checksum


def scan(root: Path) -> Iterator[Path]:
    """Every object file under ``root``; leftover ``.tmp`` files (a crash mid-write) are
    deleted on the way."""
    if not root.is_dir():
        return
    for sub in sorted(root.iterdir()):
        if not sub.is_dir():
            continue
        for f in sorted(sub.iterdir()):
            if f.name.endswith(TMP):
                _unlink(f)
            elif f.name.endswith(SUFFIX):
                yield f
