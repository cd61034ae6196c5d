"""A local-store client's connections and arena mappings (docs/store.md §Local store).

- :class:`Session`: one connection to one coordinator generation, and everything leased
  through it. It dies once (a failed or timed-out call, the coordinator closing its end,
  or the client closing it) and is never revived: a reconnect is a new session. Every
  read lease and write slot records its session, so "the session is alive and its peer
  has not hung up" is exactly "the coordinator still holds this lease for us": a dead
  session's leases are invalid before the coordinator can reclaim their bytes (it learns
  of the closed connection only after the session was marked dead).
- :class:`Arena`: one mapping of one generation's arena file, counted: the client holds one
  reference while the generation is current, and each lease and write slot holds one
  while its pointers are in use. It is unmapped (unregistered from CUDA first) only when
  the last is dropped, so a copy thread never touches memory being unmapped, even across
  a coordinator restart; sessions of one generation share it (a reconnect to the same
  coordinator maps and prefaults nothing).
- :func:`greet`: a session starts only after the runtime dir passed its checks, the
  process listening on the socket proved (``SO_PEERCRED``) to run as the dir's owner, and
  its hello named this store's own files (:mod:`.trust`, :mod:`.replies`); the arena and
  lookup index are mapped only if they are regular files of that owner, reached through
  no symlink, as large as announced.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcentric.config import StoreConfig
from kvcentric.store.base import StoreUnavailable
from kvcentric.store.local import replies, trust
from kvcentric.store.local.config import socket_path
from kvcentric.store.local.rpc import RpcClient
from kvcentric.store.local.shared_index import SharedIndexReader

if TYPE_CHECKING:
    from kvcentric.cuda.pinning import HostPinner

log = logging.getLogger("kvcentric.store")
MADV_POPULATE_WRITE = 23  # Linux 5.14+


class Arena:
    """A counted mapping of the arena file of generation ``generation``; ``base`` is its
    address here. Starts with one reference (the caller's)."""

    def __init__(self, path: str, capacity: int, generation: str, prefault: bool,
                 owner: int | None = None) -> None:
        fd = trust.open_file(path, os.O_RDWR, "store arena", owner=owner)
        try:
            size = os.fstat(fd).st_size
            if size < capacity:  # a mapping past the file's end is a SIGBUS on first touch
                raise replies.BadReply(f"the arena {path} has {size} B, less than the "
                                       f"{capacity} B the coordinator announced")
            self.mm = mmap.mmap(fd, capacity, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._anchor: Any = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(self._anchor)
        self.capacity = capacity
        self.generation = generation
        self._refs = 1
        self._lock = threading.Lock()
        self._pinner: HostPinner | None = None
        if prefault:
            _populate(self.mm, self.base, capacity)

    def pin(self, pinner: HostPinner) -> None:
        """Register the mapping with ``pinner`` (once); unregistered before it is unmapped."""
        with self._lock:
            if self._pinner is None and self._refs > 0:
                self._pinner = pinner
                pinner.register(self.base, self.capacity)

    def hold(self, n: int = 1) -> bool:
        """Take ``n`` more references; False (none taken) when the mapping is gone."""
        with self._lock:
            if self._refs <= 0:
                return False
            self._refs += n
            return True

    def drop(self, n: int = 1) -> None:
        """Give back ``n`` references; the last one unmaps."""
        with self._lock:
            self._refs -= n
            if self._refs != 0:
                return
            pinner, self._pinner = self._pinner, None
        if pinner is not None:  # a registered range must never outlive its mapping
            pinner.unregister(self.base)
        self._anchor = None
        try:
            self.mm.close()
        except BufferError:  # a view handed to a caller (arena_view) is alive; GC unmaps
            pass


def _populate(mm: mmap.mmap, base: int, size: int) -> None:
    """Fault every page in now (a first touch inside a copy costs a page fault per 4 KiB,
    which halves put bandwidth on a fresh mapping). ``madvise(MADV_POPULATE_WRITE)``
    through ctypes releases the GIL (``MAP_POPULATE`` would hold it for the whole
    arena, seconds per GiB: every engine thread would stall behind a background
    reconnect); older kernels only get a read-ahead hint."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(base, size, MADV_POPULATE_WRITE) == 0:
        return
    log.debug("MADV_POPULATE_WRITE unsupported (errno %d): the arena faults in on use",
              ctypes.get_errno())
    mm.madvise(mmap.MADV_WILLNEED)


class Session:
    """One connection to one coordinator generation (see the module docstring). Holds one
    reference on ``arena`` until closed."""

    def __init__(self, rpc: RpcClient, arena: Arena, index: SharedIndexReader | None,
                 hello: Hello, hot_timeout_s: float) -> None:
        self.rpc = rpc
        self.arena = arena
        self.index = index
        self.generation = arena.generation
        self.owner = hello.owner  # the uid whose files this session may open
        self.tier = hello.tier  # the disk tier's directory (None: no disk tier)
        self.admin = False  # presented the admin token (kvcentric.store.local.gate)
        self.max_pin_s = float(hello.raw.get("max_pin_s", 0.0))
        self.lease_ttl_s = float(hello.raw.get("lease_ttl_s") or 0.0)
        self.disk_tier = hello.tier is not None
        # a reserve may be held back this long for the disk tier (and every call of this
        # connection may queue behind one): the hot-path bound covers it
        self.hot_timeout_s = hot_timeout_s + float(hello.raw.get("reserve_wait_s") or 0.0)
        self.alive = arena.hold()

    def peer_alive(self) -> bool:
        """Alive, and the coordinator has not closed its end (one ``poll``)."""
        return self.alive and self.rpc.peer_alive()

    def close(self) -> None:
        """Dead from now on (before the socket closes: see the module docstring)."""
        if not self.alive:
            return
        self.alive = False
        self.rpc.close()
        if self.index is not None:
            self.index.close()  # a lookup racing this falls back (ValueError, handled)
        self.arena.drop()


@dataclass(frozen=True)
class Hello:
    """A coordinator's checked hello (:func:`replies.check_hello`), the uid that owns the
    store (its runtime dir's owner, which the coordinator runs as) and its disk tier."""

    raw: dict[str, Any]
    owner: int
    tier: Path | None


def greet(cfg: StoreConfig) -> tuple[RpcClient, Hello]:
    """Check ``cfg``'s runtime dir, connect to its coordinator, check who it is and say
    hello (``op_timeout_s``); the connection's reads wake every ``hot_timeout_s`` so hot
    calls end in time. ``StoreUnavailable`` when it does not answer; ``Untrusted`` or
    ``BadReply`` (both ``StoreUnavailable``) when the dir, the peer or the hello fails its
    checks (module docstring)."""
    try:
        owner = trust.check_dir(cfg.local.runtime_dir, "store runtime directory",
                                gid=cfg.local.peer_gid, mine=False)
    except FileNotFoundError as exc:
        raise StoreUnavailable(f"cannot reach store at {socket_path(cfg)}: no runtime "
                               f"directory {cfg.local.runtime_dir}") from exc
    except OSError as exc:
        raise StoreUnavailable(f"cannot examine {cfg.local.runtime_dir}: {exc}") from exc
    rpc = RpcClient(socket_path(cfg), cfg.op_timeout_s, poll_s=cfg.hot_timeout_s)
    try:
        rpc.connect(lambda sock: trust.check_peer(sock, owner, socket_path(cfg)))
        raw = rpc.call("hello")
        hello = Hello(raw, owner, replies.check_hello(cfg, raw))
    except BaseException:
        rpc.close()
        raise
    return rpc, hello


def open_index(cfg: StoreConfig, path: str | None, owner: int) -> SharedIndexReader | None:
    """Map a generation's shared lookup index (a file of ``owner``), or None (lookups use
    the socket)."""
    if not path or not cfg.local.shared_index:
        return None
    try:
        return SharedIndexReader(Path(path), owner)
    except (OSError, ValueError, StoreUnavailable) as exc:
        log.warning("shared lookup index unusable (%s); lookups use the socket", exc)
        return None
