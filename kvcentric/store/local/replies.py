"""What a local-store client accepts from its coordinator: every path, offset and size is
checked before anything is mapped, copied or opened.

The coordinator is another process, reached through a file in a directory; one that lies
(a bug, or a process speaking the protocol that is not our coordinator) must not make a
client map a file outside its store, copy bytes outside its arena or read a file outside
its disk tier. Contract (docs/store.md §Shared host):

- **hello** (:func:`check_hello`): the generation is 32 hex digits; the arena is exactly
  ``{runtime_dir}/{name}.arena.{generation}`` and the lookup index ``None`` or
  ``{runtime_dir}/{name}.index.{generation}``; the capacity is positive; the disk tier's
  directory is the one this client's config names, if it names one; the announced waits
  are bounded. The files themselves are checked when opened (a regular file of the
  store's owner, not reached through a symlink, as large as the capacity:
  :class:`~kvcentric.store.local.session.Arena`).
- **reserve** (:func:`check_slots`): one integer per key; an offset (``>= 0``) plus the
  object's size lies inside the arena.
- **acquire** (:func:`check_lease`): at most one entry per key asked for; a DRAM entry's
  ``[offset, size, ...]`` lies inside the arena; a disk entry's promotion extent is ``-1``
  or inside the arena, its size at most the arena's, and its file a path of the tier's
  layout named for its own key (the file is then opened inside the tier without following
  a symlink: :func:`kvcentric.store.local.disk.open_object`).

A reply that fails is a :class:`BadReply` (a ``StoreUnavailable``): the caller closes the
session (the coordinator reclaims its leases and slots) and the call fails as if the store
were unreachable, so the engine recomputes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kvcentric.config import StoreConfig
from kvcentric.store.base import StoreUnavailable
from kvcentric.store.local import disk
from kvcentric.store.local.config import MAX_PUT_WAIT_S, disk_dir, socket_path
from kvcentric.store.local.ownership import GENERATION_HEX, generation_file

_GENERATION = re.compile(f"[0-9a-f]{{{GENERATION_HEX}}}")
MAX_LEASE_TTL_S = 365 * 86400.0


class BadReply(StoreUnavailable):
    """The coordinator's reply breaks the protocol's bounds (the message says how)."""


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any, lo: float, hi: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi


def check_hello(cfg: StoreConfig, hello: Any) -> Path | None:
    """``BadReply`` unless ``hello`` names this store's files of its generation and sane
    bounds; returns the disk tier's directory (``None`` without a tier)."""
    if not isinstance(hello, dict):
        raise BadReply(f"the coordinator at {socket_path(cfg)} sent no hello map")
    gen = hello.get("generation")
    if not isinstance(gen, str) or not _GENERATION.fullmatch(gen):
        raise BadReply(f"the coordinator at {socket_path(cfg)} names no generation (an "
                       "older kvcentric?): restart it")
    if hello.get("arena") != str(generation_file(cfg, "arena", gen)):
        raise BadReply(f"the coordinator's arena {str(hello.get('arena'))[:200]!r} is not "
                       f"this store's ({generation_file(cfg, 'arena', gen)})")
    index = hello.get("index")
    if index is not None and index != str(generation_file(cfg, "index", gen)):
        raise BadReply(f"the coordinator's lookup index {str(index)[:200]!r} is not this "
                       "store's")
    if not _int(hello.get("capacity")) or hello["capacity"] <= 0:
        raise BadReply(f"the coordinator's capacity {hello.get('capacity')!r} is not a "
                       "positive integer")
    if not _num(hello.get("lease_ttl_s") or 0, 0, MAX_LEASE_TTL_S) \
            or not _num(hello.get("reserve_wait_s") or 0, 0, MAX_PUT_WAIT_S) \
            or not _num(hello.get("max_pin_s", 0), 0, float("inf")):
        raise BadReply("the coordinator announces a lease TTL, reserve wait or pin bound "
                       "out of range")
    if not hello.get("disk_tier"):
        return None
    mine = disk_dir(cfg)
    # an older coordinator names no directory: this client's config then says where
    raw = hello.get("disk_dir") or (str(mine.absolute()) if mine is not None else None)
    if not isinstance(raw, str) or not raw.startswith("/") or Path(raw).name in ("", ".."):
        raise BadReply(f"the coordinator's disk tier directory {str(raw)[:200]!r} is not "
                       "an absolute path")
    tier = Path(raw)
    if mine is not None and tier != mine.absolute():
        raise BadReply(f"the coordinator's disk tier is at {tier}, this client's config "
                       f"says {mine}")
    return tier


def check_slots(codes: Any, sizes: list[int], capacity: int) -> list[int]:
    """A reserve reply: one code per key, every offset's extent inside the arena."""
    if type(codes) is not list or len(codes) != len(sizes):
        raise BadReply("reserve: the coordinator's reply does not match the request")
    for off, size in zip(codes, sizes):  # type() is: a bool is no offset (hot path)
        if type(off) is not int or off >= 0 and off + size > capacity:
            raise BadReply(f"reserve: offset {off!r} of {size} B is outside the arena "
                           f"({capacity} B)")
    return codes


def check_lease(reply: Any, keys: list[str], capacity: int,
                tier: Path | None) -> tuple[int, list[list[Any]]]:
    """An acquire reply ``[lease id, entries]``: at most one entry per key, each inside
    the arena, disk files of the tier's layout named for their keys."""
    if type(reply) is not list or len(reply) != 2 or type(reply[0]) is not int \
            or type(reply[1]) is not list or len(reply[1]) > len(keys):
        raise BadReply("acquire: the coordinator's reply does not match the request")
    entries: list[list[Any]] = reply[1]
    for key, ent in zip(keys, entries):
        if type(ent) is list and len(ent) == 3:  # a DRAM object: the hot path, kept lean
            off, size, csum = ent
            if type(off) is int and type(size) is int and 0 <= off and 0 < size \
                    and off + size <= capacity and (csum is None or type(csum) is int):
                continue
            raise BadReply(f"acquire: {key[:64]!r} at {str(ent)[:200]} is not inside the "
                           f"arena ({capacity} B)")
        _check_disk_entry(key, ent, capacity, tier)
    return reply[0], entries


def _check_disk_entry(key: str, ent: Any, capacity: int, tier: Path | None) -> None:
    """``[promotion extent or -1, size, checksum, file, file checksum]`` of ``key``."""
    if type(ent) is not list or len(ent) != 5 or not _int(ent[0]) or not _int(ent[1]) \
            or not 0 < ent[1] <= capacity or not (ent[2] is None or _int(ent[2])) \
            or not _int(ent[4]):
        raise BadReply(f"acquire: entry {str(ent)[:200]} of {key[:64]!r} is malformed")
    off, size, path = ent[0], ent[1], ent[3]
    if not (off == -1 or 0 <= off <= capacity - size):
        raise BadReply(f"acquire: {key[:64]!r}'s promotion extent {off} of {size} B is "
                       "outside the arena")
    if tier is None or not isinstance(path, str):
        raise BadReply(f"acquire: {key[:64]!r} is on a disk tier this client has no "
                       "directory for")
    try:
        disk.parts(tier, path)
    except ValueError as exc:
        raise BadReply(f"acquire: {exc}") from None
    if not disk.names_key(Path(path), key) or not path.endswith(disk.SUFFIX):
        raise BadReply(f"acquire: {path[:200]!r} is not a file of {key[:64]!r}")
