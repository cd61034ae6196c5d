"""Mooncake return codes and how they map onto the ``KVStore`` ones.

Mooncake (``mooncake-store/include/types.h``) returns sizes (>= 0) or negative
``ErrorCode`` values; the ``KVStore`` codes reuse Mooncake's numbers where they mean the
same (-200 no space, -704 not found, -705 exists, -706 has lease, -800 transfer failed).
"""

from __future__ import annotations

from kvcentric.store.base import (
    ERR_CORRUPT,
    ERR_EXISTS,
    ERR_HAS_LEASE,
    ERR_INVALID,
    ERR_NO_SPACE,
    ERR_NOT_FOUND,
    ERR_TRANSFER,
    ERR_UNAVAILABLE,
)

MC_NO_SPACE = -200
# RPC_FAIL, RPC_TIMEOUT, HEARTBEAT_*, UNAVAILABLE_IN_CURRENT_STATUS/MODE: the master is away
UNREACHABLE = frozenset({-900, -901, -902, -1010, -1011})
_CODES = {
    MC_NO_SPACE: ERR_NO_SPACE,
    -703: ERR_NOT_FOUND,  # replica not ready: being written, invisible
    -704: ERR_NOT_FOUND, -710: ERR_NOT_FOUND, -712: ERR_NOT_FOUND,
    -705: ERR_EXISTS, -706: ERR_HAS_LEASE,
    -707: ERR_TRANSFER,  # lease expired before the read finished: bytes untrusted
    -800: ERR_TRANSFER, -801: ERR_CORRUPT,
    -400: ERR_INVALID, -600: ERR_INVALID, -601: ERR_INVALID, -602: ERR_INVALID,
}


def map_code(code: int) -> int:
    """A Mooncake return value as a ``KVStore`` one: sizes and 0 pass, errors map."""
    if code >= 0:
        return code
    if code in UNREACHABLE:
        return ERR_UNAVAILABLE
    return _CODES.get(code, ERR_TRANSFER)
