"""The disk tier's files: one file per object, self-describing, written atomically.

Layout of ``{dir}/{h[:2]}/{h}-{tag}.kvc`` (``h`` = xxh3_128 hex of the key; docs/store.md
§Disk tier):

- bytes ``[0, DATA_OFFSET)``: the header: ``MAGIC``, the payload size, the payload's xxh3_64,
  the key and the parent key (UTF-8), then the xxh3_64 of all of that; zero padding. A tier
  with a seal key (``DiskConfig.seal_key``) writes ``MAGIC_SEALED`` and, before that
  xxh3_64, an HMAC-SHA256 under the key of everything before it: a file whose seal does not
  verify under our key was not written by us and is never served.
- bytes ``[DATA_OFFSET, DATA_OFFSET + size)``: the object, byte for byte as in DRAM, so a
  reader's byte range ``[a, b)`` of the object is file range ``[DATA_OFFSET + a, …)``.

A file is written under a ``.tmp`` name, ``fdatasync``ed, renamed into place and its directory
fsynced, so a final name only ever holds a complete object (a crash leaves at most a
``.tmp``, which recovery deletes). Corruption after that (bit rot, a file truncated or
overwritten under us) is caught by the payload checksum: recovery checks every file before
publishing it, and every reader checks the bytes it read before they count as data.

Page cache, not ``O_DIRECT`` (docs/store.md §Disk tier): readers fetch one layer's range
at a time into arena slots that are 64-byte aligned, which ``O_DIRECT`` cannot address
without a bounce copy, and the kernel's readahead makes buffered layer-sized reads faster.
Writers and readers drop the pages they touched (``POSIX_FADV_DONTNEED``) so the tier does
not shadow DRAM in the page cache and a later read goes to the device.

**Never outside the tier.** Every file operation resolves a path below the tier's root
one level at a time through directory descriptors opened ``O_NOFOLLOW``, and opens files
``O_NOFOLLOW`` (new ones ``O_EXCL``): a symlink planted anywhere below the root (a
subdirectory, an object file, a ``*.tmp``) is never followed, so recovery and removals
never read or delete outside the tier directory. Only paths of the tier's own layout
(``{root}/{two hex}/{name}``) are accepted (:func:`parts`). The root itself must be a
directory (not a symlink) of the store's owner that no other user can write
(:func:`open_root`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import logging
import os
import re
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvcentric.store.local import trust

log = logging.getLogger("kvcentric.store")
MAGIC = b"KVCDISK1"
MAGIC_SEALED = b"KVCDISK2"  # the header carries an HMAC under the tier's seal key
_MAC = 32  # HMAC-SHA256
_SUB = re.compile(r"[0-9a-f]{2}")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# a client's lookups need only search permission (a peer_group's 0710 directories)
_PATH_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# what a tier file operation raises for a file it cannot use (refused paths included)
ERRORS = (OSError, ValueError, trust.Untrusted)
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


def _mac(seal_key: bytes, body: bytes) -> bytes:
    return hmac.new(seal_key, body, hashlib.sha256).digest()


def encode_header(key: str, parent: str | None, size: int, checksum: int,
                  seal_key: bytes | None = None) -> bytes:
    k, p = key.encode(), (parent or "").encode()
    magic = MAGIC if seal_key is None else MAGIC_SEALED
    body = _FIXED.pack(magic, size, checksum, len(k), len(p)) + k + p
    if seal_key is not None:
        body += _mac(seal_key, body)
    if len(body) + _SEAL.size > DATA_OFFSET:
        raise ValueError(f"key too long for the disk tier: {key[:64]!r}")
    body += _SEAL.pack(xxhash.xxh3_64_intdigest(body))
    return body + bytes(DATA_OFFSET - len(body))


def decode_header(raw: bytes, seal_key: bytes | None = None) -> Header | None:
    """The header in ``raw`` (a file's first ``DATA_OFFSET`` bytes), or None if torn or,
    with ``seal_key``, not sealed under that key."""
    if len(raw) < _FIXED.size:
        return None
    magic, size, csum, klen, plen = _FIXED.unpack_from(raw)
    end = _FIXED.size + klen + plen
    mac = _MAC if magic == MAGIC_SEALED else 0
    if magic not in (MAGIC, MAGIC_SEALED) or end + mac + _SEAL.size > len(raw):
        return None
    (seal,) = _SEAL.unpack_from(raw, end + mac)
    if seal != xxhash.xxh3_64_intdigest(raw[:end + mac]):
        return None
    if seal_key is not None and not (
            mac and hmac.compare_digest(raw[end:end + mac], _mac(seal_key, raw[:end]))):
        return None  # not written under our key: someone else's file
    key = raw[_FIXED.size:_FIXED.size + klen].decode()
    parent = raw[_FIXED.size + klen:end].decode() or None
    return Header(key, parent, size, csum)


def _open_dir(name: Path | str, what: str, owner: int | None, dir_fd: int | None = None,
              flags: int = _DIR_FLAGS) -> int:
    """A descriptor of directory ``name`` (never through a symlink); ``Untrusted`` unless
    it is ``owner``'s (default: ours) and no other user can write it."""
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise trust.Untrusted(f"refusing {what} {str(name)!r}: it is a symlink") from exc
        raise
    st = os.fstat(fd)
    want = os.geteuid() if owner is None else owner
    why = (f"it is not owned by uid {want}" if st.st_uid != want else
           "it is writable by group or others" if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
           else None)
    if why is not None:
        os.close(fd)
        raise trust.Untrusted(f"refusing {what} {str(name)!r}: {why} ({trust.describe(st)})")
    return fd


def open_root(root: Path, owner: int | None = None, flags: int = _DIR_FLAGS) -> int:
    """A descriptor of the tier's root directory; ``Untrusted`` unless it is a directory
    (not a symlink) of ``owner`` (default: us) that no other user can write."""
    return _open_dir(root, "disk tier directory", owner, flags=flags)


def parts(root: Path, path: Path | str) -> tuple[str, str]:
    """``(subdirectory, file name)`` of ``path`` if it is a path of the tier's layout under
    ``root`` (``{root}/{two hex}/{name}``); ``ValueError`` otherwise."""
    p = Path(path)
    if p.parent.parent != root or not _SUB.fullmatch(p.parent.name) or p.name in ("..", "."):
        raise ValueError(f"{str(p)!r} is not a file of the disk tier at {str(root)!r}")
    return p.parent.name, p.name


@contextlib.contextmanager
def _sub(root: Path, sub: str, owner: int | None = None, create: bool = False,
         gid: int | None = None, flags: int = _DIR_FLAGS) -> Iterator[int]:
    """A descriptor of ``root/sub``: neither reached through a symlink, both ``owner``'s
    and writable by nobody else; ``create`` makes ``sub`` (``0700``, ``0710`` for a
    group) when missing."""
    rfd = open_root(root, owner, flags)
    try:
        made = False
        if create:
            try:
                os.mkdir(sub, 0o700, dir_fd=rfd)
                made = True
            except FileExistsError:
                pass
        sfd = _open_dir(sub, "disk tier directory", owner, dir_fd=rfd, flags=flags)
    finally:
        os.close(rfd)
    try:
        if made and gid is not None:
            os.fchown(sfd, -1, gid)
            os.fchmod(sfd, 0o710)
        yield sfd
    finally:
        os.close(sfd)


def write_object(root: Path, path: Path, key: str, parent: str | None, data: memoryview,
                 seal_key: bytes | None = None, gid: int | None = None) -> int:
    """Write ``data`` as ``path`` (a path of ``root``'s layout: tmp + fdatasync + rename);
    returns its checksum. The caller fsyncs ``path.parent`` (:func:`fsync_dir`, batched
    over many objects). Raises ``OSError``, ``ValueError`` for a path outside the tier."""
    sub, name = parts(root, path)
    csum = xxhash.xxh3_64_intdigest(data)
    tmp = name + TMP
    with _sub(root, sub, create=True, gid=gid) as sfd:
        fd = trust.open_file(tmp, os.O_WRONLY, "disk tier file", new=True,
                             mode=0o600 if gid is None else 0o640, gid=gid, dir_fd=sfd)
        try:
            _write_all(fd, encode_header(key, parent, len(data), csum, seal_key))
            _write_all(fd, data)
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except BaseException:
            os.close(fd)
            _unlink(tmp, sfd)
            raise
        os.close(fd)
        os.rename(tmp, name, src_dir_fd=sfd, dst_dir_fd=sfd)  # replaces a symlink, never follows
    return csum


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def fsync_dir(root: Path, sub: str) -> None:
    with _sub(root, sub) as sfd:
        os.fsync(sfd)


def _unlink(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def remove_object(root: Path, path: Path | str) -> None:
    """Unlink ``path`` (of ``root``'s layout; a symlink there is removed, not followed)."""
    sub, name = parts(root, path)
    try:
        with _sub(root, sub) as sfd:
            _unlink(name, sfd)
    except FileNotFoundError:
        pass


def open_object(root: Path, path: Path | str, owner: int | None = None) -> int:
    """A read-only descriptor of the object file ``path`` (of ``root``'s layout), a regular
    file of ``owner`` (default: us) reached through no symlink; ``ValueError`` for a path
    outside the tier, ``Untrusted``/``OSError`` otherwise."""
    sub, name = parts(root, path)
    with _sub(root, sub, owner, flags=_PATH_FLAGS) as sfd:
        return trust.open_file(name, os.O_RDONLY, "disk tier file", owner=owner, dir_fd=sfd)


def read_header(root: Path, path: Path, seal_key: bytes | None = None) -> Header | None:
    """The file's header if the file is whole (header sealed, under ``seal_key`` if given,
    length right), a regular file of ours; else None."""
    try:
        fd = open_object(root, path)
    except ERRORS:
        return None
    try:
        h = decode_header(os.pread(fd, DATA_OFFSET, 0), seal_key)
        size = os.fstat(fd).st_size
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)
    if h is None or size != DATA_OFFSET + h.size:
        return None
    return h


def verify(root: Path, path: Path, h: Header) -> bool:
    """True when the file's payload has ``h.size`` bytes with checksum ``h.checksum``."""
    hasher = xxhash.xxh3_64()
    got = 0
    try:
        fd = open_object(root, path)
    except ERRORS:
        return False
    try:
        with open(fd, "rb", buffering=0, closefd=False) as f:
            f.seek(DATA_OFFSET)
            while chunk := f.read(CHUNK):
                hasher.update(chunk)
                got += len(chunk)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    finally:
        os.close(fd)
    return got == h.size and hasher.intdigest() == h.checksum


def scan(root: Path) -> Iterator[Path]:
    """Every object file under ``root``: regular files ``*.kvc`` in real subdirectories
    named by two hex digits. Leftover ``.tmp`` files (a crash mid-write) are deleted on
    the way; symlinks and anything else are left alone (logged), never followed."""
    try:
        rfd = open_root(root)
    except FileNotFoundError:
        return
    try:  # classified while the directory is open (d_type, or an lstat relative to it)
        subs = sorted((e.name, e.is_dir(follow_symlinks=False)) for e in os.scandir(rfd))
    finally:
        os.close(rfd)
    for sub, is_dir in subs:
        if not (is_dir and _SUB.fullmatch(sub)):
            log.warning("disk tier: ignoring %s (not a subdirectory of the tier's layout)",
                        root / sub)
            continue
        objects = []
        try:
            with _sub(root, sub) as sfd:
                for f in sorted(os.scandir(sfd), key=lambda e: e.name):
                    if not f.is_file(follow_symlinks=False):
                        log.warning("disk tier: ignoring %s (not a regular file)",
                                    root / sub / f.name)
                    elif f.name.endswith(TMP):
                        _unlink(f.name, sfd)
                    elif f.name.endswith(SUFFIX):
                        objects.append(root / sub / f.name)
        except ERRORS as exc:  # swapped for a symlink or removed since the listing
            log.warning("disk tier: skipping %s: %s", root / sub, exc)
            continue
        yield from objects
