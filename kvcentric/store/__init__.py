"""KV stores: one interface (:class:`KVStore`), backends ``local`` and ``mooncake``
(the table of backends: :mod:`kvcentric.store.backends`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvcentric.config import StoreConfig
from kvcentric.store.base import (
    ERR_CORRUPT,
    ERR_EXISTS,
    ERR_HAS_LEASE,
    ERR_INVALID,
    ERR_NO_SPACE,
    ERR_NOT_FOUND,
    ERR_TRANSFER,
    ERR_UNAVAILABLE,
    OK,
    KVStore,
    ReadLease,
    Residency,
    StoreUnavailable,
    WriteSlot,
    checksum,
)

__all__ = [
    "ERR_CORRUPT", "ERR_EXISTS", "ERR_HAS_LEASE", "ERR_INVALID", "ERR_NO_SPACE",
    "ERR_NOT_FOUND", "ERR_TRANSFER", "ERR_UNAVAILABLE", "OK", "KVStore", "ReadLease",
    "Residency", "StoreConfig", "StoreUnavailable", "WriteSlot", "checksum", "open_store",
]


def open_store(config: Mapping[str, Any] | StoreConfig | None = None, *,
               required: bool = True) -> KVStore:
    """Open the store ``config`` names (a dict like the connector's ``store`` extra config,
    or a :class:`StoreConfig`) through its backend's entry in
    :data:`kvcentric.store.backends.BACKENDS`. The ``local`` backend starts its coordinator
    if needed.

    ``required=False`` (engines): a store that cannot be reached or started now is not an
    error; the client's calls fail (``StoreUnavailable`` / negative codes: the engine
    recomputes) until it can be. The ``mooncake`` backend always joins in the background.
    """
    cfg = StoreConfig.from_dict(config)
    from kvcentric.store.backends import BACKENDS

    return BACKENDS[cfg.backend].open(cfg, required)  # the name was checked at parse time
