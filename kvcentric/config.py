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

import os
import re
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcentric.store.local.config import LocalSettings
    from kvcentric.store.mooncake.config import MooncakeSettings

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


def section_names() -> list[str]:
    """The store backends with a config section of their own (``store.<name>``), in
    ``kvcentric.store.backends.BACKENDS``."""
    from kvcentric.store.backends import BACKENDS  # imported late: it imports this module

    return [name for name, spec in BACKENDS.items() if spec.settings is not None]


@dataclass(frozen=True)
class StoreConfig:
    """Which KV store to open and how: what every backend shares, and each backend's own
    typed settings.

    Fields:
        backend: ``"local"`` (embedded shared-memory store), ``"mooncake"``, or another
            registered backend (``kvcentric.store.backends``).
        name: the store's name: the local store's instance name (processes with the same
            name and runtime dir share it) and every backend's label in logs and metrics.
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
            recomputes) for this long while the client reconnects in the background.
        sections: each backend's typed settings by backend name (its ``settings`` class in
            ``kvcentric.store.backends``: ``LocalSettings`` of
            ``kvcentric.store.local.config``, ``MooncakeSettings`` of
            ``kvcentric.store.mooncake.config``), parsed once, here: a mapping given for a
            section is parsed by that class, and the selected backend's section is always
            present (its defaults when not given). :attr:`settings` is the selected one;
            :attr:`local` and :attr:`mooncake` are the built-in backends', typed.

    In a mapping (:meth:`from_dict`) a backend's section is the top-level key named after
    it (``store.mooncake``, ``store.local``); the selected backend's keys may also be given
    at the top level (``capacity``, ``runtime_dir`` of a local store), as most configs do.
    ``backend`` names an entry of ``kvcentric.store.backends.BACKENDS``, which also supplies
    the ``verify_checksums`` default and the backend's own checks of the whole config.
    """

    backend: str = "local"
    name: str = "default"
    verify_checksums: bool = None  # type: ignore[assignment]  # None: the backend's, below
    op_timeout_s: float = 10.0
    hot_timeout_s: float = 0.1
    min_transfer_rate: int = 256 << 20
    reconnect_interval_s: float = 1.0
    sections: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from kvcentric.store.backends import BACKENDS, get_backend  # it imports this module

        spec = get_backend(self.backend)
        if self.verify_checksums is None:  # the backend's default, fixed here once
            object.__setattr__(self, "verify_checksums", spec.verify_checksums)
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.name):
            raise ValueError(f"store name {self.name!r} must be 1 to 64 letters, digits, "
                             "'_', '.' or '-'")
        for name in ("op_timeout_s", "reconnect_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("op_timeout_s", "hot_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.min_transfer_rate <= 0:
            raise ValueError("min_transfer_rate must be > 0 (bytes per second)")
        unknown = set(self.sections) - set(section_names())
        if unknown:
            raise ValueError(f"store sections {sorted(unknown)} name no store backend with "
                             f"settings; known: {section_names()}")
        parsed: dict[str, Any] = {}
        for key, value in self.sections.items():
            cls = BACKENDS[key].settings
            assert cls is not None  # section_names() lists only backends with settings
            parsed[key] = value if isinstance(value, cls) else cls.from_mapping(value)
        if spec.settings is not None and self.backend not in parsed:
            parsed[self.backend] = spec.settings.from_mapping(None)
        object.__setattr__(self, "sections", parsed)
        spec.check(self)

    @property
    def settings(self) -> Any:
        """The selected backend's typed settings (``None`` for a backend without any)."""
        return self.sections.get(self.backend)

    @property
    def local(self) -> LocalSettings:
        """The local backend's settings; ``ValueError`` for a store that has none."""
        return self._section("local")  # type: ignore[no-any-return]

    @property
    def mooncake(self) -> MooncakeSettings:
        """The Mooncake backend's settings; ``ValueError`` for a store that has none."""
        return self._section("mooncake")  # type: ignore[no-any-return]

    def _section(self, backend: str) -> Any:
        found = self.sections.get(backend)
        if found is None:
            raise ValueError(f"store {self.name!r} is a {self.backend} store: it has no "
                             f"{backend} settings")
        return found

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | StoreConfig | None) -> StoreConfig:
        """Parse a user dict (e.g. the connector's ``store`` extra config): the shared keys,
        the backends' sections, and the selected backend's own keys at the top level."""
        from kvcentric.store.backends import get_backend

        if isinstance(raw, StoreConfig):
            return raw
        if raw is not None and not isinstance(raw, Mapping):
            raise ValueError(f"store must be a mapping, got {type(raw).__name__}")
        raw = dict(raw or {})
        spec = get_backend(str(raw.get("backend", "local")))
        names = section_names()
        shared = {f.name for f in fields(cls) if f.init} - {"sections"}
        own = spec.own_keys
        unknown = set(raw) - shared - own - set(names)
        for key in sorted(unknown & set(spec.instead)):
            raise ValueError(f"store.{key} is not a setting of a {spec.name} store: "
                             f"{spec.instead[key]}")
        if unknown:
            raise ValueError(f"unknown keys in store: {sorted(unknown)}; known: "
                             f"{sorted(shared | own | set(names))}")
        sections: dict[str, Any] = {k: raw[k] for k in names if k in raw}
        flat = {k: raw[k] for k in own - shared if k in raw}
        if flat:
            if spec.name in sections:
                raise ValueError(f"store: give the {spec.name} store's keys "
                                 f"{sorted(flat)} at the top level or in store.{spec.name}, "
                                 "not both")
            sections[spec.name] = flat
        kw = parse_fields(cls, {k: raw[k] for k in shared if k in raw}, "store",
                          sizes={"min_transfer_rate"})
        return cls(**kw, sections=sections)

    def with_(self, **changes: Any) -> StoreConfig:
        """A copy with ``changes``: shared fields by name, and the selected backend's own
        (``runtime_dir=...`` of a local store); ``ValueError`` for a key that is neither."""
        shared = {f.name for f in fields(self)}
        own = {k: v for k, v in changes.items() if k not in shared}
        out = replace(self, **{k: v for k, v in changes.items() if k in shared})
        if not own:
            return out
        settings = out.settings
        if settings is None:
            raise ValueError(f"store: {sorted(own)} are no keys of a {self.backend} store")
        try:
            updated = replace(settings, **own)
        except TypeError:
            raise ValueError(f"store: {sorted(own)} are not all keys of a {self.backend} "
                             "store") from None
        return replace(out, sections={**out.sections, self.backend: updated})

    def to_mapping(self) -> dict[str, Any]:
        """Every field as plain JSON-able values that :meth:`from_dict` parses back to an
        equal config (the launcher hands a coordinator its config this way), each backend's
        section written by its settings class. Holds the local disk tier's seal key: pass
        it on a pipe, never on a command line."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)
                               if f.name != "sections"}
        for key, settings in self.sections.items():
            out[key] = settings.to_mapping()
        return out
