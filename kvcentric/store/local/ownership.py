"""One coordinator per store, and the fresh files of each coordinator generation.

**One coordinator.** A store (``runtime_dir``, ``name``) has at most one live coordinator:
the process that holds an exclusive ``flock`` on ``{name}.owner`` (:func:`owner_path
<kvcentric.store.local.config.owner_path>`) for its whole life. The kernel drops the lock when
that process dies (``kill -9`` included) and never while it lives: a stopped (SIGSTOP) or
swamped coordinator keeps it, so a launcher that finds the socket silent sees the lock held
(:func:`holder`) and reports the store unavailable instead of starting a second coordinator
on the same files.

**Generations.** Every coordinator is a new generation: a random 128-bit id, sent in its
hello, and files named after it (``{name}.arena.{id}``, ``{name}.index.{id}``), created
new. No coordinator ever truncates, reuses or writes another generation's files, so bytes a
client leased from a dead coordinator's arena are never overwritten by the next one's
writers. Files of dead generations are unlinked by the next coordinator once it holds the
lock (the lock proves their coordinator is gone); a client that still maps one keeps its
pages until it unmaps it, which is when tmpfs frees them.

**Trusted files.** The runtime dir must pass :func:`kvcentric.store.local.trust.check_dir`
(created ``0700``; a symlink, another user's directory or one others can write is refused
with a message naming its owner and mode); every file is opened ``O_NOFOLLOW``, and a
generation's files are created ``O_EXCL``, so nothing is ever written through a file or
symlink someone planted.

**Reserved memory.** The arena is reserved with ``posix_fallocate`` before the coordinator
serves: on a tmpfs without room it refuses to start (:class:`StartRefused`, naming the
path and the sizes) instead of handing out a sparse file whose first write past the free
space kills the writer with SIGBUS.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import time
from pathlib import Path

from kvcentric.config import StoreConfig
from kvcentric.store.local import trust
from kvcentric.store.local.config import owner_path

LOCK_WAIT_S = 1.0  # launchers probe the lock (shared, for microseconds): retry past them
GENERATION_HEX = 32  # a 128-bit generation id


class StartRefused(RuntimeError):
    """A coordinator cannot start: another holds the store, or its memory cannot be
    reserved. The message says which, with the paths and sizes."""


def generation_file(cfg: StoreConfig, kind: str, generation: str) -> Path:
    """``{name}.{kind}.{generation}`` in the runtime dir (``kind``: arena, index)."""
    return cfg.local.runtime_dir / f"{cfg.name}.{kind}.{generation}"


def generation_files(cfg: StoreConfig, kind: str) -> list[Path]:
    """Every ``kind`` file of this store, of any generation (a live one and dead ones not
    cleaned up yet); never another store's (names are matched exactly)."""
    pattern = re.compile(re.escape(f"{cfg.name}.{kind}.") + f"[0-9a-f]{{{GENERATION_HEX}}}")
    try:
        names = os.listdir(cfg.local.runtime_dir)
    except OSError:
        return []
    return [cfg.local.runtime_dir / n for n in names if pattern.fullmatch(n)]


def holder(cfg: StoreConfig) -> int | None:
    """The pid of the coordinator that holds ``cfg``'s store (0 when it is held but the pid
    is unreadable), or None when no coordinator lives. Takes the lock shared for an instant;
    a starting coordinator retries past that (:data:`LOCK_WAIT_S`)."""
    try:  # read-only: a peer_group member may probe a store it cannot write
        fd = os.open(owner_path(cfg), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # no runtime dir or lock file: nobody holds it
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_pid(fd: int) -> int:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0)
    except (OSError, ValueError):
        return 0


class Generation:
    """A claimed store: the lifetime lock, this generation's id and its files.

    :meth:`claim` takes the lock, removes dead generations' files and creates and reserves
    this generation's arena; :meth:`release` (at a clean exit) unlinks the files and drops
    the lock. The lock lives on an open file description, so it survives the coordinator's
    detaching ``fork`` (held by the child once the parent exits).
    """

    def __init__(self, cfg: StoreConfig, lock_fd: int, gid: int | None = None) -> None:
        self.cfg = cfg
        self.gid = gid  # the peer_group's: its members map the arena and read the index
        self.id = secrets.token_hex(GENERATION_HEX // 2)
        self.arena_path = generation_file(cfg, "arena", self.id)
        self.index_path = generation_file(cfg, "index", self.id)
        self._lock_fd = lock_fd

    @classmethod
    def claim(cls, cfg: StoreConfig) -> Generation:
        """Become the store's coordinator; ``StartRefused`` when the runtime dir or the
        lock file is not to be trusted (the message names path, owner and mode), another
        coordinator lives (even a stopped one) or the arena cannot be reserved."""
        try:
            gid = cfg.local.peer_gid
            trust.check_dir(cfg.local.runtime_dir, "store runtime directory", gid=gid, create=True)
            if gid is not None:  # ours: the group may reach the socket, not create files
                os.chown(cfg.local.runtime_dir, -1, gid)
                os.chmod(cfg.local.runtime_dir, 0o710)
            fd = trust.open_or_create(owner_path(cfg), os.O_RDWR, "store lock file",
                                      mode=0o600 if gid is None else 0o640, gid=gid)
        except trust.Untrusted as exc:
            raise StartRefused(str(exc)) from exc
        except (OSError, ValueError) as exc:
            raise StartRefused(f"cannot open {owner_path(cfg)}: {exc}") from exc
        try:
            _lock(fd, cfg)
            gen = cls(cfg, fd, gid)
            gen.record_pid()
            gen._remove_dead()
            reserve(gen.arena_path, cfg.local.capacity_bytes, "arena", gid)
        except BaseException:
            os.close(fd)  # drops the lock
            raise
        return gen

    def record_pid(self) -> None:
        """Write this process's pid into the lock file (for :func:`holder`'s messages);
        called again by a coordinator that detached with a ``fork``."""
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)

    def _remove_dead(self) -> None:
        """Unlink every generation file of this store: we hold the lock, so their
        coordinators are dead (clients that map one keep its pages until they unmap)."""
        for kind in ("arena", "index"):
            for path in generation_files(self.cfg, kind):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def release(self) -> None:
        """Unlink this generation's files and drop the lock (a clean exit)."""
        for path in (self.arena_path, self.index_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _lock(fd: int, cfg: StoreConfig) -> None:
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
    raise StartRefused(
        f"store {cfg.name!r} in {cfg.local.runtime_dir} already has a coordinator (pid "
        f"{_read_pid(fd) or 'unknown'} holds {owner_path(cfg)}); it may be stopped or busy: "
        "not starting a second one on its files")


def reserve(path: Path, size: int, what: str, gid: int | None = None) -> None:
    """Create ``path`` (new: ``O_EXCL``, never through a symlink; mode 0600, or 0660 and
    group ``gid``) with ``size`` bytes allocated (``posix_fallocate``);
    ``StartRefused`` naming the path, the size and the file system's free space when it
    cannot be (the file is removed then)."""
    def refused(why: str) -> StartRefused:
        return StartRefused(f"cannot reserve {size} B ({_mib(size)}) for the store's {what} "
                            f"at {path}: {why} ({_space(path.parent)}); "
                            f"{_advice(path.parent, size, what)}")

    with contextlib.suppress(OSError):  # plainly too big: say so without allocating it
        st = os.statvfs(path.parent)
        if size > st.f_bavail * st.f_frsize:
            raise refused(os.strerror(errno.ENOSPC))
    try:
        fd = trust.open_file(path, os.O_RDWR, f"store {what}", new=True,
                             mode=0o600 if gid is None else 0o660, gid=gid)
    except (OSError, trust.Untrusted) as exc:
        raise StartRefused(f"cannot create the store's {what} at {path}: {exc}") from exc
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()
        raise refused(exc.strerror or str(exc)) from exc
    os.close(fd)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n < 1 << 30 else f"{n / (1 << 30):.1f} GiB"


def _advice(directory: Path, size: int, what: str) -> str:
    """What to do when ``size`` bytes do not fit ``directory``'s file system: it is
    smaller than the file (shrink the store or enlarge the file system), or other files
    hold the room (find them: a killed run's arena is one)."""
    grow = ("a container's /dev/shm: docker run --shm-size, Kubernetes: an emptyDir with "
            "medium: Memory mounted at /dev/shm; or put the store's runtime_dir, "
            "KVCENTRIC_RUNTIME_DIR, on a larger tmpfs")
    try:
        st = os.statvfs(directory)
    except OSError:
        return f"lower the store capacity or give that file system more room ({grow})"
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    if size > total:
        return (f"the file system is smaller than the {what}: lower the store capacity "
                f"below {_mib(total)} or enlarge it ({grow})")
    return (f"other files hold {_mib(total - free)} of it (see `du -sh {directory}/* "
            f"{directory.parent}/*`; an arena left by a killed coordinator is a "
            f"NAME.arena.GENERATION file whose store has no live coordinator): remove "
            f"them, lower the store capacity below {_mib(free)}, or give it more room "
            f"({grow})")


def _space(directory: Path) -> str:
    try:
        st = os.statvfs(directory)
    except OSError:
        return "free space unknown"
    return (f"{st.f_bavail * st.f_frsize} B free of {st.f_blocks * st.f_frsize} B on "
            f"{directory}")
