"""Configuration: frozen dataclasses, parsed once, ``ValueError`` on bad values.

This module is the only place in kvcentric that reads environment variables.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class StoreConfig:
    """Which KV store to open and how.

    Fields:
        backend: ``"local"`` (embedded shared-memory store) or ``"mooncake"``.
        name: local store instance name; processes with the same name and runtime dir share it.
        capacity_bytes: hard bound on stored bytes (local backend).
        runtime_dir: directory for the local store's socket, lock and arena.
        idle_timeout_s: the local coordinator exits after this long with no clients
            (0 = never).
        autostart: the first client starts the local coordinator if none runs.
        verify_checksums: store an xxh3_64 per object at commit and check it on every read;
            a mismatch is reported as a failed read (``ERR_CORRUPT``), never as data.
        op_timeout_s: bound on one store round trip; on expiry the call fails, never hangs.
        prefault: map (and so allocate) the whole local arena when a client opens it, so no
            copy on the hot path pays page faults; costs ``capacity_bytes`` of RAM up front.
        mooncake: backend-specific settings (see ``kvcentric.store.mooncake``).
    """

    backend: str = "local"
    name: str = "default"
    capacity_bytes: int = 4 << 30
    runtime_dir: Path = field(default_factory=default_runtime_dir)
    idle_timeout_s: float = 0.0
    autostart: bool = True
    verify_checksums: bool = False
    prefault: bool = True
    op_timeout_s: float = 10.0
    start_timeout_s: float = 20.0
    mooncake: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backend not in ("local", "mooncake"):
            raise ValueError(f"unknown store backend {self.backend!r}; use 'local' or 'mooncake'")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.name):
            raise ValueError(f"store name {self.name!r} must match [A-Za-z0-9_.-]{{1,64}}")
        if self.capacity_bytes <= 0 and self.backend == "local":
            raise ValueError("capacity_bytes must be positive")
        for name in ("idle_timeout_s", "op_timeout_s", "start_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.op_timeout_s == 0 or self.start_timeout_s == 0:
            raise ValueError("op_timeout_s and start_timeout_s must be > 0")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | StoreConfig | None) -> StoreConfig:
        """Parse a user dict (e.g. the connector's ``store`` extra config)."""
        if isinstance(raw, StoreConfig):
            return raw
        raw = dict(raw or {})
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known - {"capacity"}
        if unknown:
            raise ValueError(f"unknown store config keys {sorted(unknown)}; known: {sorted(known)}")
        if "capacity" in raw:
            raw["capacity_bytes"] = raw.pop("capacity")
        if "capacity_bytes" in raw:
            raw["capacity_bytes"] = parse_size(raw["capacity_bytes"])
        if "runtime_dir" in raw:
            raw["runtime_dir"] = Path(raw["runtime_dir"])
        for name in ("idle_timeout_s", "op_timeout_s", "start_timeout_s"):
            if name in raw:
                raw[name] = float(raw[name])
        return cls(**raw)

    def with_(self, **changes: Any) -> StoreConfig:
        return replace(self, **changes)

    @property
    def socket_path(self) -> Path:
        return self.runtime_dir / f"{self.name}.sock"

    @property
    def arena_path(self) -> Path:
        return self.runtime_dir / f"{self.name}.arena"

    @property
    def lock_path(self) -> Path:
        return self.runtime_dir / f"{self.name}.lock"
