"""What a local store trusts on a shared host: its directories, its files and its peers.

``/dev/shm`` is world-writable, so a directory named after a user can be created first by
anyone, and a file in a directory someone else can write can be swapped under us. Contract
(docs/store.md §Shared host):

- **Directories** (the runtime dir, the disk tier's): created ``0700`` (``0710`` with a
  ``peer_group``, group-owned by it), and used only if :func:`check_dir` finds a real
  directory (not a symlink) owned by the store's owner and writable by nobody else (no
  group or other write bit). Anything else is :class:`Untrusted`, whose message names the
  path, its owner and its mode. The store's owner is the effective user; a client of a
  ``peer_group`` store also trusts a directory of another user whose group is that group
  (only a member of the group or root can give a directory that group), and then only a
  coordinator running as that directory's owner (:func:`check_peer`).
- **Files** are opened with ``O_NOFOLLOW | O_CLOEXEC`` (:func:`open_file`); new ones with
  ``O_EXCL`` as well, so a planted file or symlink is never written through. An existing
  file is used only if it is a regular file of the store's owner that others cannot write.
- **Peers**: the kernel's ``SO_PEERCRED`` names the process at the other end of a Unix
  socket; :func:`peer_refusal` says why a coordinator drops one (another user, not in the
  ``peer_group``), :func:`check_peer` makes a client refuse a coordinator of another user.

``Untrusted`` is a ``StoreUnavailable``: an engine that meets one recomputes, and the
coordinator turns it into a refusal to start.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import pwd
import socket
import stat
import struct
from pathlib import Path

from kvcentric.store.base import StoreUnavailable

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13; not in every Python
MAX_PEER_GROUPS = 256
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Untrusted(StoreUnavailable):
    """A directory, file or peer the store refuses to use (the message says why)."""


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def describe(st: os.stat_result) -> str:
    """``owner alice (uid 1000), group alice (gid 1000), mode 0o700``."""
    return (f"owner {_user(st.st_uid)}, group {_group(st.st_gid)}, "
            f"mode {oct(stat.S_IMODE(st.st_mode))}")


def _refuse(path: Path | str, st: os.stat_result, why: str, what: str) -> Untrusted:
    hint = (f"; it must be a directory of {_user(os.geteuid())} that no other user can "
            "write: remove it, or point the store elsewhere"
            if what.endswith("directory") else "")
    return Untrusted(f"refusing {what} {str(path)!r}: {why} ({describe(st)}){hint}")


def check_dir(path: Path, what: str, gid: int | None = None, create: bool = False,
              mine: bool = True) -> int:
    """Check (creating it first when ``create``) the directory ``path``; return its
    owner's uid. ``Untrusted`` when it is a symlink or no directory, is writable by group
    or others, or is not ours (``mine``; without it, a directory of another user whose
    group is ``gid`` passes too: a ``peer_group`` client). ``OSError`` when it cannot be
    created or examined; ``FileNotFoundError`` when it is missing and not ``create``."""
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        else:  # ours: the mode exactly (a umask may have taken bits), the group's if any
            if gid is not None:
                os.chown(path, -1, gid)
            os.chmod(path, 0o700 if gid is None else 0o710)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, st, "it is a symlink", what)
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, st, "it is not a directory", what)
    ours = st.st_uid == os.geteuid()
    if not ours and (mine or gid is None or st.st_gid != gid):
        raise _refuse(path, st, "it is not owned by " + _user(os.geteuid()), what)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _refuse(path, st, "it is writable by group or others", what)
    return st.st_uid


def check_fd(fd: int, path: Path | str, owner: int, what: str) -> os.stat_result:
    """The ``fstat`` of an opened file, if it is a regular file of ``owner`` that others
    cannot write; else ``Untrusted`` (the caller closes ``fd``)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, st, "it is not a regular file", what)
    if st.st_uid != owner:
        raise _refuse(path, st, f"it is not owned by {_user(owner)}", what)
    if st.st_mode & stat.S_IWOTH:
        raise _refuse(path, st, "it is writable by others", what)
    return st


def open_file(path: Path | str, flags: int, what: str, *, owner: int | None = None,
              new: bool = False, mode: int = 0o600, gid: int | None = None,
              dir_fd: int | None = None) -> int:
    """``os.open`` with ``O_NOFOLLOW | O_CLOEXEC``. ``new``: ``O_CREAT | O_EXCL`` (never an
    existing file or a symlink), exactly ``mode``, group ``gid`` if given. Else the file
    must pass :func:`check_fd` for ``owner`` (default: us). ``Untrusted`` for a symlink or
    a file that fails the check; ``OSError`` otherwise."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if new else 0)
    try:
        fd = os.open(path, flags, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            st = os.lstat(path, dir_fd=dir_fd)
            raise _refuse(path, st, "it is a symlink", what) from exc
        raise
    try:
        if new:
            if gid is not None:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, mode)  # the umask may have taken bits the group needs
        else:
            check_fd(fd, path, os.geteuid() if owner is None else owner, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_or_create(path: Path | str, flags: int, what: str, mode: int = 0o600,
                   gid: int | None = None) -> int:
    """Our file at ``path``: created (``O_EXCL``) if missing, else opened and checked."""
    for _ in range(8):  # a file removed between the two opens: create it then
        try:
            return open_file(path, flags, what, new=True, mode=mode, gid=gid)
        except FileExistsError:
            pass
        with contextlib.suppress(FileNotFoundError):
            return open_file(path, flags, what)
    raise OSError(errno.EAGAIN, f"{path} keeps appearing and disappearing")


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket (the one
    that connected, or the one that listened)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    pid, uid, gid = _CRED.unpack(raw)
    return pid, uid, gid


def _peer_groups(sock: socket.socket) -> list[int]:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * MAX_PEER_GROUPS)
    except OSError:
        return []
    return list(struct.unpack(f"{len(raw) // 4}I", raw[:len(raw) // 4 * 4]))


def peer_refusal(sock: socket.socket, gid: int | None) -> str | None:
    """Why a coordinator must drop the peer on ``sock`` (None: it may stay): another user
    than ours, unless ``gid`` is its group or one of its supplementary groups."""
    pid, uid, pgid = peer_cred(sock)
    if uid == os.geteuid():
        return None
    if gid is not None and (pgid == gid or gid in _peer_groups(sock)):
        return None
    allowed = f" or a member of {_group(gid)}" if gid is not None else ""
    return (f"peer pid {pid} runs as {_user(uid)}, not {_user(os.geteuid())}{allowed}")


def check_peer(sock: socket.socket, owner: int, path: Path) -> None:
    """A client's check of its coordinator: ``Untrusted`` unless the process listening on
    ``path`` runs as ``owner`` (the runtime dir's owner: us, or a ``peer_group`` store's)."""
    pid, uid, _ = peer_cred(sock)
    if uid != owner:
        raise Untrusted(f"refusing the store coordinator at {str(path)!r}: it runs as "
                        f"{_user(uid)} (pid {pid}), not {_user(owner)}")
