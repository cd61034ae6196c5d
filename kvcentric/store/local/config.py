"""The ``local`` backend's settings: the ``store.local`` section (or, as most configs give
it, the store mapping's top-level keys that are not shared by every backend), its disk tier
(``store.disk``) and its standard KV events (``store.events``). Frozen dataclasses, parsed
once, ``ValueError`` on bad values; with :mod:`kvcentric.config` and
:mod:`kvcentric.store.mooncake.config`, the only reader of environment variables in the
store (``KVCENTRIC_RUNTIME_DIR``).

The files of one local store are named after the store (:attr:`StoreConfig.name
<kvcentric.config.StoreConfig.name>`) in its runtime dir: :func:`socket_path`,
:func:`token_path`, :func:`owner_path`, :func:`lock_path`; its disk tier's files are under
:func:`disk_dir`.
"""

from __future__ import annotations

import grp
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from kvcentric.config import is_loopback, parse_fields

if TYPE_CHECKING:
    from kvcentric.config import StoreConfig


def default_runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where local stores keep their socket and shared-memory arena.

    ``KVCENTRIC_RUNTIME_DIR`` (in ``env``, ``os.environ`` when ``None``) overrides; the
    default is tmpfs (``/dev/shm``) so the arena never hits a disk.
    """
    given = (os.environ if env is None else env).get("KVCENTRIC_RUNTIME_DIR")
    if given:
        return Path(given)
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    return base / f"kvcentric-{os.getuid()}"


def _existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _tree_bytes(path: Path) -> int:
    """Bytes held by the regular files under ``path`` (a restarted store's own disk tier
    counts as available to it)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f), follow_symlinks=False).st_size
            except OSError:
                pass
    return total


MAX_DISK_WRITERS = 64
MIN_SEAL_KEY = 16  # characters of a disk tier's seal key
MAX_PIN_S = 3600.0  # a soft pin bounds a handoff, not a retention policy
MAX_PUT_WAIT_S = 0.5  # a held-back put must stay well inside any client's op timeout
DEFAULT_DIRTY_LIMIT = 0.5


_EVENT_ENDPOINT = re.compile(r"^(tcp://(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]+):\d{1,5}"
                             r"|ipc:///\S+)$")


@dataclass(frozen=True)
class EventsConfig:
    """The local store's standard KV events (docs/store.md §KV events): RFC #1527
    ``stored``/``removed``/``cleared`` for its DRAM (``cpu``) and disk (``disk``) tiers.

    Fields:
        endpoint: the ZMQ PUB socket the coordinator binds (``tcp://HOST:PORT`` or
            ``ipc:///path``); subscribers connect.
        replay_endpoint: the ROUTER socket it binds for replays (vLLM's protocol: a
            subscriber that missed batches asks for them by sequence number), or ``None``.
        buffer_batches: batches kept for replay (the oldest dropped first).
        allow_remote: bind a non-loopback ``tcp`` address (anyone who reaches it sees which
            prefixes the store holds).

    Needs pyzmq (the ``router`` extra); checked here, once.
    """

    endpoint: str
    replay_endpoint: str | None = None
    buffer_batches: int = 10_000
    allow_remote: bool = False

    def __post_init__(self) -> None:
        import importlib.util

        for name in ("endpoint", "replay_endpoint"):
            ep = getattr(self, name)
            if ep is None and name == "replay_endpoint":
                continue
            m = _EVENT_ENDPOINT.match(ep) if isinstance(ep, str) else None
            if m is None:
                raise ValueError(f"store.events.{name} must be tcp://HOST:PORT or ipc:///path, "
                                 f"got {ep!r}")
            host = (m.group("host") or "").strip("[]")
            if host and not self.allow_remote and not is_loopback(host):
                raise ValueError(f"store.events.{name} {ep} is not a loopback address: set "
                                 "store.events.allow_remote: true to publish beyond this host")
        if self.replay_endpoint == self.endpoint:
            raise ValueError("store.events.replay_endpoint must differ from its endpoint")
        if not isinstance(self.buffer_batches, int) or self.buffer_batches < 1:
            raise ValueError("store.events.buffer_batches must be a positive integer")
        if importlib.util.find_spec("zmq") is None:
            raise ValueError("store.events needs pyzmq, which is not installed: "
                             "pip install 'kvcentric[router]'")

    def to_mapping(self) -> dict[str, Any]:
        """Every field, as :meth:`from_dict` reads it back."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | EventsConfig) -> EventsConfig:
        if isinstance(raw, EventsConfig):
            return raw
        return cls(**parse_fields(cls, raw, "store.events"))


@dataclass(frozen=True)
class DiskConfig:
    """The local store's optional disk (SSD) tier (docs/store.md §Disk tier).

    Fields:
        path: directory of the tier's files; the store keeps them in ``path/{name}/``.
        capacity_bytes: hard bound on the bytes the tier's files take.
        writers: demotion threads (each writes and fsyncs whole objects; several keep a
            device's queue busy, which one writer waiting on each fsync does not).
        high_watermark: demotion runs while DRAM holds more than this fraction of its
            capacity in objects with no disk copy, so a DRAM eviction finds a clean copy
            to drop. 0 (the default) writes every object back as soon as a writer is free:
            a burst of puts then has all of ``dirty_limit`` to fill before it waits (a
            higher watermark leaves that much less room, so a burst of large puts waits on
            the demoter sooner), and once DRAM is full every object is written anyway, on
            its way out. A higher value saves the writes of objects that never leave DRAM.
        dirty_limit: writers are held back (the page cache's ``dirty_ratio``) while DRAM
            holds at least this fraction of its capacity in committed objects with no disk
            copy: a new reserve waits for the demoter (at most ``put_wait_s``). In
            ``[high_watermark, 1]``; unset, 0.5 or ``high_watermark`` if that is higher
            (:attr:`dirty_fraction`).
        put_wait_s: the longest a reserve waits for demotion to make room before it is
            refused (``ERR_NO_SPACE``, counted ``refused_undemoted``); 0 refuses at once.
            At most ``MAX_PUT_WAIT_S``: a hot-path store call must not wait much longer
            (kvcentric.store.local.tiered's docstring has the whole contract).
        seal_key: when set (at least 16 characters), every object file carries an
            HMAC-SHA256 under this key of its header (key, parent, size and the payload's
            checksum), and a restart serves only files whose seal verifies: files another
            writer put in the tier's directory are deleted, not served. Changing the key
            drops the tier's files at the next restart. The launcher passes it to the
            coordinator on a pipe, never on a command line.

    :meth:`from_dict` checks the file system once (``ValueError``): ``path`` must be a
    directory (or creatable under a writable one) and ``capacity_bytes`` must fit in its
    free space plus what the tier's files there already take.
    """

    path: Path
    capacity_bytes: int
    writers: int = 4
    high_watermark: float = 0.0
    dirty_limit: float | None = None
    put_wait_s: float = 0.025
    seal_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError("store.disk.capacity must be positive")
        if self.seal_key is not None and len(self.seal_key) < MIN_SEAL_KEY:
            raise ValueError(f"store.disk.seal_key must have at least {MIN_SEAL_KEY} "
                             "characters")
        if not 1 <= self.writers <= MAX_DISK_WRITERS:
            raise ValueError(f"store.disk.writers must be in [1, {MAX_DISK_WRITERS}]")
        if not 0.0 <= self.high_watermark <= 1.0:
            raise ValueError("store.disk.high_watermark must be in [0, 1]")
        if self.dirty_limit is not None and not self.high_watermark <= self.dirty_limit <= 1:
            raise ValueError("store.disk.dirty_limit must be in [high_watermark, 1]")
        if not 0.0 <= self.put_wait_s <= MAX_PUT_WAIT_S:
            raise ValueError(f"store.disk.put_wait_s must be in [0, {MAX_PUT_WAIT_S}]")

    @property
    def dirty_fraction(self) -> float:
        """``dirty_limit``, or its default when unset."""
        return self.dirty_limit if self.dirty_limit is not None else max(
            DEFAULT_DIRTY_LIMIT, self.high_watermark)

    def to_mapping(self) -> dict[str, Any]:
        """Every field (the seal key too), as :meth:`from_dict` reads it back."""
        return {f.name: str(getattr(self, f.name)) if f.name == "path" else getattr(self, f.name)
                for f in fields(self)}

    @classmethod
    def from_dict(cls, raw: Any) -> DiskConfig:
        if isinstance(raw, DiskConfig):
            return raw
        if isinstance(raw, Mapping) and "capacity" in raw and "capacity_bytes" in raw:
            raise ValueError("store.disk: give capacity or capacity_bytes, not both")
        kw = parse_fields(cls, raw, "store.disk", aliases={"capacity": "capacity_bytes"},
                          sizes={"capacity_bytes"})
        if "path" not in kw or "capacity_bytes" not in kw:
            raise ValueError("store.disk needs path and capacity")
        cfg = cls(**kw)
        cfg.check_space()
        return cfg

    def check_space(self) -> None:
        """``ValueError`` unless the tier can live at ``path`` with its capacity."""
        path = self.path.expanduser()
        base = _existing_ancestor(path.absolute())
        if not base.is_dir():
            raise ValueError(f"store.disk.path {str(self.path)!r}: {str(base)!r} is not a "
                             "directory")
        if not os.access(base, os.W_OK | os.X_OK):
            raise ValueError(f"store.disk.path {str(self.path)!r}: {str(base)!r} is not "
                             "writable")
        st = os.statvfs(base)
        free = st.f_bavail * st.f_frsize
        mine = _tree_bytes(path) if path.is_dir() else 0
        if free + mine <= 0:
            raise ValueError(f"store.disk.path {str(self.path)!r}: no free space")
        if self.capacity_bytes > free + mine:
            raise ValueError(f"store.disk.capacity {self.capacity_bytes} B exceeds the free "
                             f"space at {str(self.path)!r} ({free + mine} B)")


@dataclass(frozen=True)
class LocalSettings:
    """How the local store (one coordinator, a shared-memory arena) runs.

    Fields:
        capacity_bytes: hard bound on stored bytes (the arena's size).
        runtime_dir: directory for the store's socket, lock and arena.
        idle_timeout_s: the coordinator exits after this long with no clients (0 = never).
        autostart: the first client starts the coordinator if none runs.
        prefault: map (and so allocate) the whole arena when a client opens it, so no copy
            on the hot path pays page faults; costs ``capacity_bytes`` of RAM up front.
        start_timeout_s: how long a client waits for a coordinator it started to answer.
        disk_read_timeout_s: bound on waiting for one disk-tier read (a ``fetch_range`` of
            a streamed lease, an eager lease's reads, a release waiting for reads in
            flight); a late read fails the lease (the engine recomputes).
        shared_index: clients answer ``batch_exists`` from the coordinator's shared-memory
            index instead of a round trip (docs/store.md §Shared-memory lookups).
        lease_ttl_s: a read lease older than this is reclaimed by the coordinator, so a hung
            but connected client cannot pin objects forever (0 = never).
        peer_group: a group (name or gid) whose members may use this store too: its
            coordinator accepts their connections (``SO_PEERCRED``) and makes the runtime
            dir (``0710``), socket, arena (``0660``) and lookup index (``0640``) theirs to
            use; its clients trust a runtime dir of another user whose group it is. ``None``
            (the default): the store's user only. Admin operations stay the user's (the
            token is ``0600``).
        max_pin_s: the longest soft pin (``batch_commit(pin_s=...)``) a client may ask for
            without the store's admin token (longer ones, up to ``MAX_PIN_S``, need it; the
            client presents it when it can read it).
        max_pinned_bytes: the most bytes one connection may hold soft-pinned; a pin beyond
            it is refused (the object is committed unpinned, counted ``pins_refused``).
            ``None``: half the capacity (:attr:`pinned_bytes_cap`).
        disk: the disk tier (:class:`DiskConfig`), or ``None`` for DRAM only.
        events: the standard KV events (:class:`EventsConfig`), or ``None``.
    """

    ALIASES: ClassVar[Mapping[str, str]] = {"capacity": "capacity_bytes"}

    capacity_bytes: int = 4 << 30
    runtime_dir: Path = field(default_factory=default_runtime_dir)
    idle_timeout_s: float = 0.0
    autostart: bool = True
    prefault: bool = True
    start_timeout_s: float = 20.0
    disk_read_timeout_s: float = 5.0
    shared_index: bool = True
    lease_ttl_s: float = 300.0
    peer_group: str | None = None
    max_pin_s: float = 60.0
    max_pinned_bytes: int | None = None
    disk: DiskConfig | None = None
    events: EventsConfig | None = None

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        for name in ("idle_timeout_s", "lease_ttl_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("start_timeout_s", "disk_read_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if not 0 <= self.max_pin_s <= MAX_PIN_S:
            raise ValueError(f"max_pin_s must be in [0, {MAX_PIN_S}]")
        if self.max_pinned_bytes is not None and self.max_pinned_bytes < 0:
            raise ValueError("max_pinned_bytes must be >= 0")
        if self.peer_group is not None:
            self.peer_gid  # noqa: B018 (a ValueError naming an unknown group, here)
        if self.disk is not None and not isinstance(self.disk, DiskConfig):
            raise ValueError("disk must be a DiskConfig (parse mappings with from_dict)")
        if self.events is not None and not isinstance(self.events, EventsConfig):
            raise ValueError("events must be an EventsConfig (parse mappings with from_dict)")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None,
                     env: Mapping[str, str] | None = None) -> LocalSettings:
        """Parse the ``store.local`` keys (``capacity`` is ``capacity_bytes``; ``disk`` and
        ``events`` are mappings); ``runtime_dir`` defaults to :func:`default_runtime_dir` of
        ``env``."""
        if raw is not None and "capacity" in raw and "capacity_bytes" in raw:
            raise ValueError("store: give capacity or capacity_bytes, not both")
        kw = parse_fields(cls, raw, "store", aliases=cls.ALIASES,
                          sizes={"capacity_bytes", "max_pinned_bytes"})
        kw.setdefault("runtime_dir", default_runtime_dir(env))
        if kw.get("disk") is not None:
            kw["disk"] = DiskConfig.from_dict(kw["disk"])
        if kw.get("events") is not None:
            kw["events"] = EventsConfig.from_dict(kw["events"])
        return cls(**kw)

    def to_mapping(self) -> dict[str, Any]:
        """Every field as plain JSON-able values that :meth:`from_mapping` parses back to an
        equal object. Holds the disk tier's seal key: pass it on a pipe, never on a
        command line."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue  # every field that may be None defaults to None
            if isinstance(value, (DiskConfig, EventsConfig)):
                out[f.name] = value.to_mapping()
            else:
                out[f.name] = str(value) if isinstance(value, Path) else value
        return out

    @property
    def peer_gid(self) -> int | None:
        """The gid of ``peer_group`` (``ValueError`` when no such group exists)."""
        g = self.peer_group
        if g is None:
            return None
        if g.isdigit():
            return int(g)
        try:
            return grp.getgrnam(g).gr_gid
        except KeyError:
            raise ValueError(f"store.peer_group {g!r} is not a group on this host") from None

    @property
    def pinned_bytes_cap(self) -> int:
        """``max_pinned_bytes``, or half the capacity when unset."""
        return (self.max_pinned_bytes if self.max_pinned_bytes is not None
                else self.capacity_bytes // 2)


def socket_path(cfg: StoreConfig) -> Path:
    """The coordinator's Unix socket."""
    return cfg.local.runtime_dir / f"{cfg.name}.sock"


def owner_path(cfg: StoreConfig) -> Path:
    """The file whose lock the store's one live coordinator holds for its whole life (its
    arena and index files are per coordinator: ``store.local.ownership``)."""
    return cfg.local.runtime_dir / f"{cfg.name}.owner"


def lock_path(cfg: StoreConfig) -> Path:
    """The file whose lock serialises the clients that check for and start a
    coordinator."""
    return cfg.local.runtime_dir / f"{cfg.name}.lock"


def token_path(cfg: StoreConfig) -> Path:
    """The coordinator's admin token (``0600``, next to its socket)."""
    return cfg.local.runtime_dir / f"{cfg.name}.token"


def disk_dir(cfg: StoreConfig) -> Path | None:
    """Where the store's disk-tier files live (``None`` without a disk tier)."""
    disk = cfg.local.disk
    return None if disk is None else disk.path.expanduser() / cfg.name
