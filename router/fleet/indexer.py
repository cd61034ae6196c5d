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


_Entry = tuple[Scope, int, Owner]


class TierIndex:
    """Owners of each ``(scope, sequence hash)``, with a bounded LRU per publisher."""

    def __init__(self) -> None:
        self._holders: dict[tuple[Scope, int], set[Owner]] = {}
        self._entries: dict[str, OrderedDict[_Entry, None]] = {}
        self._capacity: dict[str, int] = {}
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
        for h in hashes:
            entry = (scope, h, owner)
            if entry in lru:
                lru.move_to_end(entry)
                continue
            lru[entry] = None
            self._holders.setdefault((scope, h), set()).add(owner)
        while len(lru) > self._capacity[key]:
            old, _ = lru.popitem(last=False)
            self._unset(old)
            self.forgotten += 1

    def remove(self, key: str, scope: Scope, hashes: Iterable[int], owner: Owner) -> None:
        """Publisher ``key`` says ``owner`` no longer holds these blocks."""
        lru = self._entries[key]
        for h in hashes:
            entry = (scope, h, owner)
            if entry in lru:
                del lru[entry]
                self._unset(entry)

    def clear(self, key: str, medium: str | None = None) -> None:
        """Publisher ``key`` dropped everything (on ``medium`` only, when given)."""
        lru = self._entries[key]
        gone = [e for e in lru if medium is None or e[2].medium == medium]
        for entry in gone:
            del lru[entry]
            self._unset(entry)

    def _unset(self, entry: _Entry) -> None:
        scope, h, owner = entry
        holders = self._holders.get((scope, h))
        if holders is not None:
            holders.discard(owner)
            if not holders:
                del self._holders[(scope, h)]

    def blocks(self) -> int:
        """Distinct ``(scope, hash)`` blocks held by anyone."""
        return len(self._holders)

    def scopes(self) -> dict[Scope, int]:
        """Blocks per scope (the debug view)."""
        out: dict[Scope, int] = {}
        for scope, _ in self._holders:
            out[scope] = out.get(scope, 0) + 1
        return out

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
        for depth, h in enumerate(hashes):
            holders = self._holders.get((scope, h))
            if not holders or not any(alive.values()):
                break
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
