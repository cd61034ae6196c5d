"""Configuration: frozen dataclasses, parsed once, ``ValueError`` on bad values.

Every parser in kvcentric (store, connectors, Mooncake, router) goes through
:func:`parse_fields`: unknown keys are a ``ValueError`` naming the key and the known ones,
and values are coerced to the field's declared type once (``"false"`` is false, not a
truthy string). The config layer (this module, ``kvcentric.store.mooncake.config`` for
Mooncake's own ``MOONCAKE_*``/``MC_*`` variables) is the library's only reader of
environment variables, and no library code writes ``os.environ`` (only the
``kvcentric store mooncake-node`` command sets Mooncake's bind address for its own
process; test helpers build environments for the processes they start).
"""

from __future__ import annotations

import grp
import os
import re
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(value: Any, name: str = "value") -> bool:
    """``True``/``False``, ``1``/``0``, or one of ``true yes on 1`` / ``false no off 0``
    (any case); anything else is a ``ValueError`` naming ``name``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{name} must be true or false, got {value!r}")


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """``value`` as the declared type ``hint`` (bool, int, float, str, Path, or an optional
    of one); other types pass through for the dataclass to check."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(hint)):
            return None
        return _coerce(value, args[0], name) if len(args) == 1 else value
    if hint is bool:
        return parse_bool(value, name)
    try:
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if hint is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a{'n integer' if hint is int else ' number'}, "
                         f"got {value!r}") from None
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}")
        return value
    if hint is Path:
        return Path(value)
    return value


def check_keys(cls: type, raw: Any, section: str, extra: Collection[str] = ()) -> None:
    """``ValueError`` unless ``raw`` is a mapping whose keys are fields of the dataclass
    ``cls`` (or in ``extra``); the message names the unknown keys and the known ones."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{section} must be a mapping, got {type(raw).__name__}")
    known = {f.name for f in fields(cls) if f.init} | set(extra)
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"unknown keys in {section}: {sorted(unknown)}; known: {sorted(known)}")


def parse_fields(cls: type, raw: Mapping[str, Any] | None, section: str, *,
                 aliases: Mapping[str, str] | None = None, sizes: Collection[str] = (),
                 ignore: Collection[str] = ()) -> dict[str, Any]:
    """Check ``raw`` against the dataclass ``cls`` and return constructor keywords.

    ``aliases`` maps accepted spellings to field names (``capacity`` -> ``capacity_bytes``);
    ``sizes`` names fields parsed by :func:`parse_size`; keys in ``ignore`` are accepted and
    dropped. Unknown keys raise ``ValueError`` naming them, the section and the known keys.
    """
    if raw is None:
        return {}
    aliases = aliases or {}
    check_keys(cls, raw, section, extra=set(aliases) | set(ignore))
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in ignore:
            continue
        name = aliases.get(key, key)
        label = f"{section}.{key}"
        out[name] = parse_size(value) if name in sizes else _coerce(value, hints[name], label)
    return out

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: int | str) -> int:
    """Parse ``4096``, ``"512mb"``, ``"16gb"``, ``"1.5GiB"`` into bytes (binary units)."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"invalid size {value!r}; use bytes or e.g. '512mb', '16gb'")
    unit = (m.group(2) or "b").lower()[0]
    return int(float(m.group(1)) * _UNITS[unit])


def triton_interpret() -> bool:
    """Triton's own ``TRITON_INTERPRET`` switch (kernels on CPU tensors), as a boolean;
    an unparsable value counts as off, as it does for Triton."""
    try:
        return parse_bool(os.environ.get("TRITON_INTERPRET", "0"))
    except ValueError:
        return False


@dataclass(frozen=True)
class EngineEnv:
    """What kvcentric's tools (``kvcentric doctor``) read of an engine's environment:
    vLLM's plugin allow-list (``VLLM_PLUGINS``; ``None`` = every plugin loads) and the API
    key engines demand (``VLLM_API_KEY``, else the ``KVCENTRIC_ROUTER_UPSTREAM_API_KEY``
    deploy/kubernetes gives the router pod)."""

    vllm_plugins: str | None = None
    api_key: str | None = None

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> EngineEnv:
        env = os.environ if env is None else env
        return cls(env.get("VLLM_PLUGINS"),
                   env.get("VLLM_API_KEY") or env.get("KVCENTRIC_ROUTER_UPSTREAM_API_KEY")
                   or None)


def default_runtime_dir() -> Path:
    """Where local stores keep their socket and shared-memory arena.

    ``KVCENTRIC_RUNTIME_DIR`` overrides; the default is tmpfs (``/dev/shm``) so the arena
    never hits a disk.
    """
    env = os.environ.get("KVCENTRIC_RUNTIME_DIR")
    if env:
        return Path(env)
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


def is_loopback(host: str) -> bool:
    """A host name or address that stays on this machine (``localhost`` or a loopback IP;
    any other name may resolve elsewhere)."""
    if host == "localhost":
        return True
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
            a burst of puts then has all of ``dirty_limit`` to fill before it waits (at
            0.25 the dirty quarter left behind made every 16 MiB put of bench_store's disk
            run wait: 1.6-2.3 vs 4.6-5.6 GB/s), and once DRAM is full every object is
            written anyway, on its way out. A higher value saves the writes of objects
            that never leave DRAM.
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


def section_names() -> list[str]:
    """The store backends with a config section of their own (``store.<name>``), in
    ``kvcentric.store.backends.BACKENDS``."""
    from kvcentric.store.backends import BACKENDS  # imported late: it imports this module

    return [name for name, spec in BACKENDS.items() if spec.settings is not None]


@dataclass(frozen=True)
class StoreConfig:
    """Which KV store to open and how.

    Fields:
        backend: ``"local"`` (embedded shared-memory store), ``"mooncake"``, or another
            registered backend (``kvcentric.store.backends``).
        name: local store instance name; processes with the same name and runtime dir share it.
        capacity_bytes: hard bound on stored bytes (local backend).
        runtime_dir: directory for the local store's socket, lock and arena.
        idle_timeout_s: the local coordinator exits after this long with no clients
            (0 = never).
        autostart: the first client starts the local coordinator if none runs.
        verify_checksums: store an xxh3_64 per object at commit and check it on every read;
            a mismatch is reported as a failed read (``ERR_CORRUPT``), never as data.
            ``None`` (the default): on for ``mooncake``, whose objects cross a network that
            Mooncake neither authenticates nor protects, off for ``local``. Every client of
            one Mooncake cluster must agree (``kvcentric.store.mooncake.checksums``).
        op_timeout_s: bound on one administrative round trip (stats, keys, clear, remove,
            the hello of a reconnect); on expiry the call fails, never hangs.
        hot_timeout_s: bound on one hot-path round trip of the local store (``reserve``,
            ``commit``, ``acquire``, lookups over the socket: what a forward pass or the
            scheduler waits on). On expiry the connection is closed (its leases lapse) and
            the circuit breaker opens (``reconnect_interval_s``). Also the bound on one
            Mooncake call (a lookup; a data call adds its bytes at ``min_transfer_rate``):
            on expiry the call is abandoned and the breaker opens (docs/store.md §Mooncake).
        min_transfer_rate: bytes per second below which a transfer counts as hung: a
            Mooncake data call moving ``n`` bytes is abandoned after ``hot_timeout_s + n /
            min_transfer_rate``, and the vLLM worker gives up a step's loads after its
            ``load_timeout_s`` plus their bytes at this rate (late loads are recomputed).
        reconnect_interval_s: the circuit breaker: after a failed or timed-out call, or a
            failed (re)start, calls fail fast (``StoreUnavailable`` / a miss: the engine
            recomputes) for this long while the local client reconnects in the background.
        disk_read_timeout_s: bound on waiting for one disk-tier read (a ``fetch_range`` of
            a streamed lease, an eager lease's reads, a release waiting for reads in
            flight); a late read fails the lease (the engine recomputes).
        prefault: map (and so allocate) the whole local arena when a client opens it, so no
            copy on the hot path pays page faults; costs ``capacity_bytes`` of RAM up front.
        shared_index: local clients answer ``batch_exists`` from the coordinator's
            shared-memory index instead of a round trip (docs/store.md §Shared-memory lookups).
        lease_ttl_s: a read lease older than this is reclaimed by the local coordinator, so
            a hung but connected client cannot pin objects forever (0 = never).
        peer_group: a group (name or gid) whose members may use this local store too: its
            coordinator accepts their connections (``SO_PEERCRED``) and makes the runtime
            dir (``0710``), socket, arena (``0660``) and lookup index (``0640``) theirs to
            use; its clients trust a runtime dir of another user whose group it is. ``None``
            (the default): the store's user only. Admin operations stay the user's (the
            token is ``0600``).
        max_pin_s: the longest soft pin (``batch_commit(pin_s=...)``) a client may ask for
            without the store's admin token (longer ones, up to ``MAX_PIN_S``, need it; the
            local client presents it when it can read it).
        max_pinned_bytes: the most bytes one connection of the local store may hold
            soft-pinned; a pin beyond it is refused (the object is committed unpinned,
            counted ``pins_refused``). ``None``: half the capacity
            (:attr:`pinned_bytes_cap`).
        disk: the local store's disk tier (:class:`DiskConfig`), or ``None`` for DRAM only.
        events: the local store's standard KV events (:class:`EventsConfig`), or ``None``.
        sections: each backend's own section, by backend name, as given (``store.mooncake``
            is the Mooncake backend's, read by ``kvcentric.store.mooncake.config``); the
            backend parses it into its typed settings when it opens
            (``kvcentric.store.backends``). In a mapping the sections are top-level keys.

    ``backend`` names an entry of ``kvcentric.store.backends.BACKENDS``, which also supplies
    the ``verify_checksums`` default and the backend's own checks of these fields.
    """

    backend: str = "local"
    name: str = "default"
    capacity_bytes: int = 4 << 30
    runtime_dir: Path = field(default_factory=default_runtime_dir)
    idle_timeout_s: float = 0.0
    autostart: bool = True
    verify_checksums: bool = None  # type: ignore[assignment]  # None: the backend's, below
    prefault: bool = True
    op_timeout_s: float = 10.0
    hot_timeout_s: float = 0.1
    min_transfer_rate: int = 256 << 20
    start_timeout_s: float = 20.0
    reconnect_interval_s: float = 1.0
    disk_read_timeout_s: float = 5.0
    shared_index: bool = True
    lease_ttl_s: float = 300.0
    peer_group: str | None = None
    max_pin_s: float = 60.0
    max_pinned_bytes: int | None = None
    disk: DiskConfig | None = None
    events: EventsConfig | None = None
    sections: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from kvcentric.store.backends import get_backend  # the registry imports this module

        spec = get_backend(self.backend)
        if self.verify_checksums is None:  # the backend's default, fixed here once
            object.__setattr__(self, "verify_checksums", spec.verify_checksums)
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.name):
            raise ValueError(f"store name {self.name!r} must be 1 to 64 letters, digits, "
                             "'_', '.' or '-'")
        for name in ("idle_timeout_s", "op_timeout_s", "start_timeout_s",
                     "reconnect_interval_s", "lease_ttl_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("op_timeout_s", "start_timeout_s", "hot_timeout_s",
                     "disk_read_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if not 0 <= self.max_pin_s <= MAX_PIN_S:
            raise ValueError(f"max_pin_s must be in [0, {MAX_PIN_S}]")
        if self.max_pinned_bytes is not None and self.max_pinned_bytes < 0:
            raise ValueError("max_pinned_bytes must be >= 0")
        if self.peer_group is not None:
            self.peer_gid  # noqa: B018 (a ValueError naming an unknown group, here)
        if self.min_transfer_rate <= 0:
            raise ValueError("min_transfer_rate must be > 0 (bytes per second)")
        if self.disk is not None and not isinstance(self.disk, DiskConfig):
            raise ValueError("disk must be a DiskConfig (parse mappings with from_dict)")
        if self.events is not None and not isinstance(self.events, EventsConfig):
            raise ValueError("events must be an EventsConfig (parse mappings with from_dict)")
        unknown = set(self.sections) - set(section_names())
        if unknown:
            raise ValueError(f"store sections {sorted(unknown)} name no store backend with "
                             f"settings; known: {section_names()}")
        spec.check(self)

    @property
    def mooncake(self) -> Mapping[str, Any]:
        """The Mooncake backend's section as given (``{}`` when absent)."""
        return self.sections.get("mooncake") or {}

    @property
    def disk_dir(self) -> Path | None:
        """Where this store's disk-tier files live (``None`` without a disk tier)."""
        return None if self.disk is None else self.disk.path.expanduser() / self.name

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | StoreConfig | None) -> StoreConfig:
        """Parse a user dict (e.g. the connector's ``store`` extra config)."""
        if isinstance(raw, StoreConfig):
            return raw
        if raw is not None and "capacity" in raw and "capacity_bytes" in raw:
            raise ValueError("store: give capacity or capacity_bytes, not both")
        names = section_names()
        if raw is not None:  # a backend's section is a top-level key named after it
            if not isinstance(raw, Mapping):
                raise ValueError(f"store must be a mapping, got {type(raw).__name__}")
            known = {f.name for f in fields(cls) if f.init} - {"sections"} | {"capacity",
                                                                              *names}
            unknown = set(raw) - known
            if unknown:
                raise ValueError(f"unknown keys in store: {sorted(unknown)}; known: "
                                 f"{sorted(known)}")
        sections = {k: v for k, v in (raw or {}).items() if k in names}
        kw = parse_fields(cls, {k: v for k, v in (raw or {}).items() if k not in names},
                          "store", aliases={"capacity": "capacity_bytes"},
                          sizes={"capacity_bytes", "max_pinned_bytes", "min_transfer_rate"})
        if sections:
            kw["sections"] = sections
        if kw.get("disk") is not None:
            kw["disk"] = DiskConfig.from_dict(kw["disk"])
        if kw.get("events") is not None:
            kw["events"] = EventsConfig.from_dict(kw["events"])
        return cls(**kw)

    def with_(self, **changes: Any) -> StoreConfig:
        return replace(self, **changes)

    def to_mapping(self, *, sections: bool = True) -> dict[str, Any]:
        """Every field as plain JSON-able values that :meth:`from_dict` parses back to an
        equal config (the launcher hands a coordinator its config this way). Holds the disk
        tier's seal key: pass it on a pipe, never on a command line. ``sections=False``
        leaves the backends' own sections out."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "sections":
                if sections:
                    out |= {k: dict(v) if isinstance(v, Mapping) else v
                            for k, v in value.items()}
            elif value is None:
                continue  # every field that may be None defaults to None
            elif isinstance(value, (DiskConfig, EventsConfig)):
                out[f.name] = value.to_mapping()
            else:
                out[f.name] = str(value) if isinstance(value, Path) else value
        return out

    @property
    def socket_path(self) -> Path:
        return self.runtime_dir / f"{self.name}.sock"

    @property
    def owner_path(self) -> Path:
        """The file whose lock the store's one live coordinator holds for its whole life
        (its arena and index files are per coordinator: ``store.local.ownership``)."""
        return self.runtime_dir / f"{self.name}.owner"

    @property
    def lock_path(self) -> Path:
        return self.runtime_dir / f"{self.name}.lock"

    @property
    def token_path(self) -> Path:
        """The local coordinator's admin token (``0600``, next to its socket)."""
        return self.runtime_dir / f"{self.name}.token"

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
