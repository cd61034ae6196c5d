"""Store backends: the one table of what ``backend:`` in a store config may name.

A backend is a :class:`StoreBackend`: its name, the typed dataclass of its own config
section (``store.<name>``, parsed by the class's ``from_mapping(raw, env)`` and written back
by its ``to_mapping()``), the function that opens it, and what the doctor and the command
line do with it. :data:`BACKENDS` is the explicit table; everything that depends on the
backend (:func:`kvcentric.store.open_store`, :class:`kvcentric.config.StoreConfig`'s checks,
``kvcentric doctor``, ``kvcentric store``) looks the name up here, so adding a backend is a
new package plus one entry (:func:`register_backend` or ``BACKENDS[name] = spec``).

Importing this module imports no backend's heavy dependencies: the built-in entries reach
their packages (``kvcentric.store.local``, ``kvcentric.store.mooncake``, the doctor's checks)
only when called.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

from kvcentric.store.local.config import LocalSettings  # plain dataclasses: no client, no wheel
from kvcentric.store.mooncake.config import MooncakeSettings

if TYPE_CHECKING:
    from kvcentric.config import StoreConfig
    from kvcentric.doctor.findings import Finding
    from kvcentric.store.base import KVStore


class BackendSettings(Protocol):
    """What a backend's typed config class provides: a frozen dataclass built once, when the
    :class:`~kvcentric.config.StoreConfig` is parsed, from its ``store.<name>`` mapping (and
    the environment ``env``, ``os.environ`` when ``None``; only config classes read it) with
    ``ValueError`` on bad values, and that mapping back. Its init fields, and the spellings
    in an optional ``ALIASES`` class mapping, are the keys a config may also give at the
    top level of the store mapping when it selects this backend."""

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None,
                     env: Mapping[str, str] | None = None) -> BackendSettings: ...

    def to_mapping(self) -> dict[str, Any]: ...


def _no_check(cfg: StoreConfig) -> None:
    return None


def _unchanged(cfg: StoreConfig) -> StoreConfig:
    return cfg


def _reachable(cfg: StoreConfig) -> list[Finding]:
    """The doctor's default check of a backend: it opens (as the doctor opens stores: no
    autostart, fail fast) and answers ``stats``."""
    from kvcentric.doctor.findings import FAIL, OK, Finding
    from kvcentric.doctor.stores import diagnosis_config
    from kvcentric.store.base import StoreUnavailable

    try:
        with BACKENDS[cfg.backend].open(diagnosis_config(cfg), True) as store:
            stats = store.stats()
    except (StoreUnavailable, OSError, ValueError) as exc:
        return [Finding("store-reachable", FAIL, f"{cfg.backend} store {cfg.name!r} is not "
                        f"reachable: {exc}", "check the store config")]
    return [Finding("store-reachable", OK, f"{cfg.backend} store {cfg.name!r}: "
                    f"{stats.get('keys', '?')} keys", details={"stats": stats})]


def _list_keys(cfg: StoreConfig, prefix: str, limit: int) -> list[str]:
    """Keys through the backend's own client (:meth:`KVStore.list_keys`)."""
    from kvcentric.doctor.stores import diagnosis_config

    with BACKENDS[cfg.backend].open(diagnosis_config(cfg), True) as store:
        return store.list_keys(prefix, limit)


def _remove_keys(cfg: StoreConfig, keys: Sequence[str]) -> None:
    from kvcentric.doctor.stores import diagnosis_config

    with BACKENDS[cfg.backend].open(diagnosis_config(cfg), True) as store:
        for k in keys:
            store.remove(k, force=True)


@dataclass(frozen=True)
class StoreBackend:
    """One store backend.

    Fields:
        name: the ``backend:`` value that selects it, and the key of its own config section.
        open: ``open(cfg, required)`` -> a :class:`~kvcentric.store.base.KVStore` for a
            parsed config; ``required=False`` (engines) must not fail on a store that is
            merely unreachable now (its calls fail until it is reachable).
        settings: the typed config class of its ``store.<name>`` section
            (:class:`BackendSettings`), or ``None`` when it takes no section.
        check: extra ``ValueError`` checks of the shared :class:`~kvcentric.config.StoreConfig`
            fields (e.g. refusing the local store's disk tier); run once, at parse time.
        verify_checksums: the default of ``StoreConfig.verify_checksums`` for it.
        doctor_checks: ``kvcentric doctor``'s findings about a store of this backend
            (read-only; default: it opens and answers ``stats``).
        list_keys: ``(cfg, prefix, limit)`` -> stored keys, for the doctor's layout probe
            (default: through its client's ``list_keys``).
        remove_keys: removes the doctor probe's keys (default: through its client).
        add_commands: adds its ``kvcentric store`` subcommands to an argparse subparsers
            object, or ``None``.
        instead: what to say of another backend's key given to this one (``store.disk`` to a
            Mooncake store: use Mooncake's own SSD offload), by key.
        passive: ``cfg`` as a look that changes nothing opens it (the doctor, the metrics
            exporter): e.g. the local store's starts no coordinator and maps no arena in
            (default: unchanged).
    """

    name: str
    open: Callable[[StoreConfig, bool], KVStore]
    settings: type[BackendSettings] | None = None
    check: Callable[[StoreConfig], None] = _no_check
    verify_checksums: bool = False
    doctor_checks: Callable[[StoreConfig], list[Finding]] = _reachable
    list_keys: Callable[[StoreConfig, str, int], list[str]] = _list_keys
    remove_keys: Callable[[StoreConfig, Sequence[str]], None] = _remove_keys
    add_commands: Callable[[argparse._SubParsersAction], None] | None = None  # type: ignore[type-arg]
    passive: Callable[[StoreConfig], StoreConfig] = _unchanged
    instead: Mapping[str, str] = field(default_factory=dict)

    @property
    def own_keys(self) -> set[str]:
        """The keys of its section a store mapping may also give at the top level: its
        settings class's init fields and ``ALIASES`` (none without a settings class)."""
        if self.settings is None:
            return set()
        keys = {f.name for f in fields(self.settings) if f.init}  # type: ignore[arg-type]
        return keys | set(getattr(self.settings, "ALIASES", {}))

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", self.name):
            raise ValueError(f"store backend name {self.name!r} must be 1 to 32 lower-case "
                             "letters, digits or '_', starting with a letter")


# ---- the built-in backends: thin wrappers, so that their packages load only when used ----

def _open_local(cfg: StoreConfig, required: bool) -> KVStore:
    from kvcentric.store.local.client import LocalStore

    return LocalStore(cfg, required)


def _passive_local(cfg: StoreConfig) -> StoreConfig:
    return cfg.with_(autostart=False, prefault=False)


def _local_doctor(cfg: StoreConfig) -> list[Finding]:
    from kvcentric.doctor.stores import check_local_store, check_shm

    reach, stats = check_local_store(cfg)
    return [reach, check_shm(cfg, stats)]


def _open_mooncake(cfg: StoreConfig, required: bool) -> KVStore:
    # Mooncake always joins in the background: ``required`` changes nothing
    from kvcentric.store.mooncake.store import MooncakeStore  # type: ignore[import-not-found]

    return MooncakeStore(cfg)  # type: ignore[no-any-return]


def _mooncake_doctor(cfg: StoreConfig) -> list[Finding]:
    from kvcentric.doctor.stores import check_mooncake_master, check_transport

    return [check_mooncake_master(cfg.mooncake), check_transport(cfg.mooncake)]


def _mooncake_keys(cfg: StoreConfig, prefix: str, limit: int) -> list[str]:
    # the master's key dump: no Mooncake client (and no segment) joins for a look
    from kvcentric.store.mooncake.http import fetch_keys

    return [k for k in fetch_keys(cfg.mooncake.metrics_url) if k.startswith(prefix)]


def _mooncake_remove(cfg: StoreConfig, keys: Sequence[str]) -> None:
    return None  # no Mooncake client here: the doctor probe's few objects age out


def _mooncake_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvcentric.store.mooncake.service import add_mooncake_commands

    add_mooncake_commands(sub)


BACKENDS: dict[str, StoreBackend] = {
    "local": StoreBackend("local", _open_local, settings=LocalSettings,
                          doctor_checks=_local_doctor, passive=_passive_local),
    "mooncake": StoreBackend("mooncake", _open_mooncake, settings=MooncakeSettings,
                             verify_checksums=True, instead={
                                 "events": "a Mooncake master publishes its own KV events "
                                           "(enable_kv_events), registered with the router's "
                                           "indexer as type Mooncake",
                                 "disk": "for Mooncake's own SSD offload set "
                                         "mooncake.ssd_offload_path"},
                             doctor_checks=_mooncake_doctor, list_keys=_mooncake_keys,
                             remove_keys=_mooncake_remove, add_commands=_mooncake_commands),
}
"""Every backend a store config may name, by name (insertion order: the order listed)."""


def get_backend(name: str) -> StoreBackend:
    """The backend called ``name``; ``ValueError`` naming the known ones otherwise."""
    spec = BACKENDS.get(name)
    if spec is None:
        names = [repr(n) for n in BACKENDS]
        known = " or ".join(names) if len(names) < 3 else (", ".join(names[:-1])
                                                          + " or " + names[-1])
        raise ValueError(f"unknown store backend {name!r}; use {known}")
    return spec


def register_backend(spec: StoreBackend) -> None:
    """Add ``spec`` to :data:`BACKENDS`; ``ValueError`` when its name is taken, by another
    backend or by a ``StoreConfig`` key (its section is a top-level key of the store config)."""
    from kvcentric.config import StoreConfig

    if spec.name in BACKENDS:
        raise ValueError(f"store backend {spec.name!r} is already registered")
    taken = {f.name for f in fields(StoreConfig)}
    for other in BACKENDS.values():  # a backend's own keys may be given at the top level
        taken |= other.own_keys
    if spec.name in taken:
        raise ValueError(f"store backend {spec.name!r} would shadow the store key of that name")
    BACKENDS[spec.name] = spec


def passive_config(cfg: StoreConfig, op_timeout_s: float) -> StoreConfig:
    """``cfg`` as a look that changes nothing opens it (its backend's :attr:`StoreBackend.
    passive`), failing fast: calls bounded by ``op_timeout_s`` at most, no breaker wait."""
    quick = cfg.with_(op_timeout_s=min(cfg.op_timeout_s, op_timeout_s),
                      reconnect_interval_s=0.0)
    return BACKENDS[cfg.backend].passive(quick)
