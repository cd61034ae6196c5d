"""The standard indexer's prefix index: which instance can serve which prefix, from which tier.

What Mooncake's Conductor indexer API answers (docs/router.md §Indexer API): for a prompt
as rolling sequence hashes (:mod:`kvcentric.seq_hash`), each instance's longest leading
run of blocks it can serve, overall, per medium (``GPU``, ``CPU``, ``DISK``) and per data
parallel rank. Blocks are held by *owners*:

- an engine publisher's blocks (vLLM, SGLang) belong to its instance and DP rank, on the
  medium its events name (``gpu`` unless they say otherwise);
- a shared store's blocks (a Mooncake master, kvcentric's store) belong to the pool: every
  instance of the scope can load them, so they count for each one, on ``cpu`` or ``disk``.

Scopes keep apart what must never match: model, LoRA adapter, block size, salt and
tenant. Memory is bounded per publisher (an LRU of its entries, the oldest forgotten
first), so a publisher that floods or whose removals are lost cannot grow the index.

Single-threaded: call it from the router's event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

GPU = "gpu"
STANDARD_MEDIA = ("gpu", "cpu", "disk")


@dataclass(frozen=True)
class Scope:
    """What a block's hash means: equal hashes in two scopes are different blocks."""

    model: str
    lora_name: str
    block_size: int
    salt: str
    tenant_id: str


@dataclass(frozen=True)
class Owner:
    """Who holds a block. ``instance_id`` None: a shared pool (``backend`` names it),
    loadable by every instance of the scope."""

    backend: str
    medium: str
    instance_id: str | None = None
    dp_rank: int = 0


@dataclass
class Match:
    """One instance's leading runs, in blocks."""

    longest: int = 0
    media: dict[str, int] = field(default_factory=dict)
    dp: dict[int, int] = field(default_factory=dict)

    def as_json(self, block_size: int) -> dict[str, object]:
        """The Conductor API's shape: tokens, media upper-case, DP ranks as strings."""
        out: dict[str, object] = {"longest_matched": self.longest * block_size}
        for medium in (*STANDARD_MEDIA, *sorted(set(self.media) - set(STANDARD_MEDIA))):
            out[medium.upper()] = self.media.get(medium, 0) * block_size
        out["DP"] = {str(r): n * block_size for r, n in sorted(self.dp.items())}
        return out


T = TypeVar("T")


class _Interned(Generic[T]):
    """Values by int id, each counted by the index entries that hold it and forgotten when
    none does. Ids are never reused, so a stale id can name no other value."""

    def __init__(self) -> None:
        self.ids: dict[T, int] = {}
        self.values: dict[int, T] = {}
        self._refs: dict[int, int] = {}
        self._next = 0

    def intern(self, value: T) -> int:
        """``value``'s id, a new one (held by nothing yet) when it has none."""
        i = self.ids.get(value)
        if i is None:
            i = self.ids[value] = self._next
            self._next += 1
            self.values[i] = value
            self._refs[i] = 0
        return i

    def hold(self, i: int, n: int) -> None:
        """``n`` more (or fewer) entries hold ``i``; at none it is forgotten."""
        left = self._refs[i] + n
        if left > 0:
            self._refs[i] = left
            return
        del self._refs[i]
        del self.ids[self.values.pop(i)]


_Entry = tuple[int, int, int]  # (scope id, sequence hash, owner id)


class TierIndex:
    """Owners of each ``(scope, sequence hash)``, with a bounded LRU per publisher.

    Scopes and owners are interned to ints and a block's owners kept as a tuple of them:
    every per-block key, entry and owner list is a tuple of ints, which the garbage
    collector stops tracking once it has seen it. With a scope object and a set of owners
    in each, every full collection visited every block the fleet holds."""

    def __init__(self) -> None:
        self._holders: dict[tuple[int, int], tuple[int, ...]] = {}
        self._entries: dict[str, OrderedDict[_Entry, None]] = {}
        self._capacity: dict[str, int] = {}
        self._scopes: _Interned[Scope] = _Interned()
        self._owners: _Interned[Owner] = _Interned()
        self.forgotten = 0  # entries dropped by a publisher's bound

    def add_publisher(self, key: str, capacity: int) -> None:
        """Start tracking publisher ``key`` with at most ``capacity`` entries."""
        if key in self._entries:
            raise ValueError(f"publisher {key} is already tracked")
        if capacity < 1:
            raise ValueError("capacity must be positive")
        self._entries[key] = OrderedDict()
        self._capacity[key] = capacity

    def drop_publisher(self, key: str) -> None:
        """Forget publisher ``key`` and every block it told of."""
        self.clear(key)
        del self._entries[key]
        del self._capacity[key]

    def entries(self, key: str) -> int:
        return len(self._entries[key])

    def store(self, key: str, scope: Scope, hashes: Iterable[int], owner: Owner) -> None:
        """Publisher ``key`` says ``owner`` holds these blocks of ``scope`` now."""
        lru = self._entries[key]
        sid, oid = self._scopes.intern(scope), self._owners.intern(owner)
        added = 0
        for h in hashes:
            entry = (sid, h, oid)
            if entry in lru:
                lru.move_to_end(entry)
                continue
            lru[entry] = None
            added += 1
            holders = self._holders.get((sid, h), ())
            if oid not in holders:
                self._holders[(sid, h)] = (*holders, oid)
        self._scopes.hold(sid, added)
        self._owners.hold(oid, added)
        while len(lru) > self._capacity[key]:
            old, _ = lru.popitem(last=False)
            self._unset(old)
            self.forgotten += 1

    def remove(self, key: str, scope: Scope, hashes: Iterable[int], owner: Owner) -> None:
        """Publisher ``key`` says ``owner`` no longer holds these blocks."""
        lru = self._entries[key]
        sid, oid = self._scopes.ids.get(scope), self._owners.ids.get(owner)
        if sid is None or oid is None:
            return  # nothing of that scope or owner is held
        for h in hashes:
            entry = (sid, h, oid)
            if entry in lru:
                del lru[entry]
                self._unset(entry)

    def clear(self, key: str, medium: str | None = None) -> None:
        """Publisher ``key`` dropped everything (on ``medium`` only, when given)."""
        lru = self._entries[key]
        owners = self._owners.values
        gone = [e for e in lru if medium is None or owners[e[2]].medium == medium]
        for entry in gone:
            del lru[entry]
            self._unset(entry)

    def _unset(self, entry: _Entry) -> None:
        sid, h, oid = entry
        holders = self._holders.get((sid, h), ())
        if oid in holders:
            rest = tuple(o for o in holders if o != oid)
            if rest:
                self._holders[(sid, h)] = rest
            else:
                del self._holders[(sid, h)]
        self._scopes.hold(sid, -1)
        self._owners.hold(oid, -1)

    def blocks(self) -> int:
        """Distinct ``(scope, hash)`` blocks held by anyone."""
        return len(self._holders)

    def scopes(self) -> dict[Scope, int]:
        """Blocks per scope (the debug view)."""
        per_id: dict[int, int] = {}
        for sid, _ in self._holders:
            per_id[sid] = per_id.get(sid, 0) + 1
        return {self._scopes.values[sid]: n for sid, n in per_id.items()}

    def match(self, scope: Scope, hashes: Sequence[int],
              instances: Mapping[str, Iterable[int]]) -> dict[str, Match]:
        """Each instance's leading runs over ``hashes`` (root first) in ``scope``;
        ``instances``: instance id -> its DP ranks. A block counts for an instance when
        the instance holds it (on that medium, that rank) or the shared pool does: a
        rank loads from the pool as well as from its own cache."""
        out = {i: Match(dp={r: 0 for r in ranks}) for i, ranks in instances.items()}
        # alive dimensions per instance: None = any medium and rank, "m:<medium>", "dp:<r>"
        alive: dict[str, set[str | None]] = {i: {None, *(f"dp:{r}" for r in m.dp)}
                                             for i, m in out.items()}
        sid = self._scopes.ids.get(scope)
        owners = self._owners.values
        for depth, h in enumerate(hashes):
            ids = self._holders.get((sid, h)) if sid is not None else None
            if not ids or not any(alive.values()):
                break
            holders = [owners[o] for o in ids]
            shared = {o.medium for o in holders if o.instance_id is None}
            own: dict[str, set[tuple[int, str]]] = {}
            for o in holders:
                if o.instance_id is not None and o.instance_id in out:
                    own.setdefault(o.instance_id, set()).add((o.dp_rank, o.medium))
            for inst, dims in alive.items():
                if not dims:
                    continue
                mine = own.get(inst, set())
                here_media = shared | {m for _, m in mine}
                here_ranks = {r for r, _ in mine}
                m = out[inst]
                if depth == 0:  # a medium's run can only start at the root
                    dims.update(f"m:{x}" for x in here_media)
                for d in list(dims):
                    if d is None:
                        ok = bool(here_media)
                    elif d.startswith("m:"):
                        ok = d[2:] in here_media
                    else:
                        ok = bool(shared) or int(d[3:]) in here_ranks
                    if not ok:
                        dims.discard(d)
                        continue
                    if d is None:
                        m.longest = depth + 1
                    elif d.startswith("m:"):
                        m.media[d[2:]] = depth + 1
                    else:
                        m.dp[int(d[3:])] = depth + 1
        return out
