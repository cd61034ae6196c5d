"""The router's view of the global store: which leading blocks of a prompt it holds, and
which of those only on its disk tier (slower to load).

One batched ``batch_residency`` per request at most (``batch_exists`` plus each object's
tier; one round trip at most), behind a TTL cache keyed by block hash: a block seen present
is trusted, with the tier it was seen in, for ``ttl_s`` (an eviction or a tier move
meanwhile costs one mispredicted load time or hit that the engine recomputes, never a wrong
token), and the first missing block is remembered for ``negative_ttl_s`` so a burst of
misses does not hammer the store.

Keys: ``KeySpace(model_id, layout_sig, 0, tp_size)``, exactly the connector's rank-0 keys.
The layout signature folds in engine details (ISA, KV layout, dtype, block size) the router
cannot see, so it is either configured (``keys.layout_sig``: for fleets mixing layouts, and
for large mooncake deployments, whose ``list_keys`` dumps every key) or discovered once
from the keys engines have stored (``list_keys("kvc/v2/{model_id}/")``). Before any engine
stored a block there is nothing to find, which is also the right answer (0 blocks).

With a :class:`~kvcentric.router.fleet.store_events.StoreFeed` (the store's own KV events,
``store_events`` in the router config) the view answers from the feed alone: no store
call, no cache, no discovery (the feed learns the layout from the events).

Thread use: store calls run on one worker thread so a slow store never blocks the event
loop; callers wait at most ``wait_s`` and otherwise use what the cache knows. A store whose
client answers from memory it maps (the local store's shared index, without a disk tier:
:meth:`~kvcentric.store.base.KVStore.residency_nowait`) is asked on the loop instead: a
hand-off to the thread cost the router more CPU than the lookup.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvcentric.config import StoreConfig
from kvcentric.hashing import KEY_PREFIX, KeySpace, TailRef
from kvcentric.router.fleet.store_events import StoreFeed
from kvcentric.store import KVStore, Residency, StoreUnavailable, open_store

log = logging.getLogger("router.fleet.store_view")
_RETRY_S = 2.0  # how soon to retry opening the store or discovering the layout
SWEEP_TTLS = 5  # answers older than this many TTLs are swept out (bounded memory)


class StoreView:
    """Leading run of a hash chain present in the store, with a TTL cache."""

    def __init__(self, cfg: StoreConfig | None, model_id: str, *, layout_sig: str | None = None,
                 tp_size: int = 1, ttl_s: float = 2.0, negative_ttl_s: float = 0.25,
                 wait_s: float = 0.25, clock: Callable[[], float] = time.monotonic,
                 feed: StoreFeed | None = None) -> None:
        self.cfg = cfg
        self.feed = feed
        self.model_id = model_id
        self.tp_size = tp_size
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.wait_s = wait_s
        self._clock = clock
        self._keyspace = KeySpace(model_id, layout_sig, 0, tp_size) if layout_sig else None
        self._present: dict[bytes | TailRef, float] = {}
        self._absent: dict[bytes | TailRef, float] = {}
        self._disk: set[bytes | TailRef] = set()  # of _present: last seen only on disk
        self._next_sweep = 0.0  # expired answers are dropped every SWEEP_TTLS x ttl_s
        self._store: KVStore | None = None
        self._next_try = 0.0
        self._next_discover = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self.queries = 0
        self.errors = 0

    @property
    def enabled(self) -> bool:
        return self.cfg is not None or self.feed is not None

    @property
    def layout_sig(self) -> str | None:
        ks = self.feed.keyspace if self.feed is not None else self._keyspace
        return ks.layout_sig if ks else None

    # ---- the cache (event-loop side, never blocks) ----
    def cached_run(self, hashes: Sequence[bytes | TailRef], now: float | None = None
                   ) -> tuple[int, bool]:
        """``(run, final)``: blocks known present, and whether that is the whole answer
        (all present, or the next one known absent) so no store call is needed."""
        if self.feed is not None:
            return self.feed.residency(hashes)[0], True
        if self.cfg is None:
            return 0, True
        now = self._clock() if now is None else now
        present = self._present
        i = 0
        for h in hashes:
            exp = present.get(h)
            if exp is None or exp < now:
                break
            i += 1
        if i == len(hashes):
            return i, True
        return i, self._absent.get(hashes[i], 0.0) >= now

    def cached_disk(self, hashes: Sequence[bytes | TailRef], run: int) -> tuple[int, ...]:
        """Ascending positions ``< run`` of ``hashes`` last seen only on the disk tier."""
        disk = self._disk
        if not disk:
            return ()
        return tuple(i for i, h in enumerate(hashes[:run]) if h in disk)

    def record(self, hashes: Sequence[bytes | TailRef], start: int, run: int,
               now: float, disk_only: Sequence[int] = ()) -> None:
        """Remember that ``hashes[start:start+run]`` are present, those at positions
        ``disk_only`` (relative to ``start``) only on disk, and that the next is not."""
        exp = now + self.ttl_s
        seen = hashes[start:start + run]
        for h in seen:
            self._present[h] = exp
        self._disk.difference_update(seen)
        self._disk.update(seen[i] for i in disk_only)
        if start + run < len(hashes):
            self._absent[hashes[start + run]] = now + self.negative_ttl_s
        if (now >= self._next_sweep or len(self._present) > 1_000_000
                or len(self._absent) > 100_000):
            self._expire(now)
            # answers live ttl_s: without a sweep the cache grows with every prefix ever
            # seen (a soak's router: ~0.35 MiB per 1000 requests until the size bound)
            self._next_sweep = now + SWEEP_TTLS * max(self.ttl_s, self.negative_ttl_s)

    def reset(self) -> None:
        """Forget cached answers (the block size changed, so hashes name other blocks)."""
        self._present = {}
        self._absent = {}
        self._disk = set()

    def _expire(self, now: float) -> None:
        self._present = {h: e for h, e in self._present.items() if e >= now}
        self._absent = {h: e for h, e in self._absent.items() if e >= now}
        self._disk = {h for h in self._disk if h in self._present}

    # ---- store calls (worker thread) ----
    def query(self, hashes: Sequence[bytes | TailRef], start: int = 0) -> int:
        """Blocking: ask the store for the leading run of ``hashes[start:]`` and its tiers
        (recorded in the cache); returns the total run (``start`` plus what the store
        holds). Never raises."""
        now = self._clock()
        store = self._open(now)
        ks = self._discover(store, now) if store is not None else None
        if store is None or ks is None:
            return start
        self.queries += 1
        try:
            res = store.batch_residency([ks.key_of(h) for h in hashes[start:]])
        except (StoreUnavailable, OSError, ValueError) as exc:
            self.errors += 1
            log.warning("store batch_residency failed: %s", exc)
            return start
        self.record(hashes, start, res.run, self._clock(), res.disk_only)
        return start + res.run

    def _open(self, now: float) -> KVStore | None:
        if self._store is not None or self.cfg is None or now < self._next_try:
            return self._store
        try:
            self._store = open_store(self.cfg)
        except (StoreUnavailable, OSError, ValueError) as exc:
            self.errors += 1
            self._next_try = now + _RETRY_S
            log.warning("store %s unreachable (%s); retrying in %.0f s", self.cfg.name, exc,
                        _RETRY_S)
        return self._store

    def _discover(self, store: KVStore, now: float) -> KeySpace | None:
        if self._keyspace is not None or now < self._next_discover:
            return self._keyspace
        self._next_discover = now + _RETRY_S
        prefix = f"{KEY_PREFIX}/{self.model_id}/"
        try:
            keys = store.list_keys(prefix, 256)
        except (StoreUnavailable, OSError, ValueError) as exc:
            log.warning("cannot list store keys: %s", exc)
            return None
        sigs = Counter(k[len(prefix):].split("/", 1)[0] for k in keys)
        if not sigs:
            return None  # nothing stored for this model yet: 0 blocks is the right answer
        sig, _ = sigs.most_common(1)[0]
        if len(sigs) > 1:
            log.warning("several layouts stored for %s: %s; using %s (pin keys.layout_sig)",
                        self.model_id, sorted(sigs), sig)
        self._keyspace = KeySpace(self.model_id, sig, 0, self.tp_size)
        log.info("store key layout for %s discovered: %s", self.model_id, sig)
        return self._keyspace

    # ---- async front ----
    async def residency(self, hashes: Sequence[bytes | TailRef]) -> Residency:
        """Leading items of ``hashes`` (block hashes, then possibly the prompt's tail)
        present in the store, and the positions among them it holds only on disk (cache
        first, then one store call; the feed alone when there is one)."""
        if self.feed is not None:
            return Residency(*self.feed.residency(hashes))
        run, final = self.cached_run(hashes)
        if not final:
            nowait = self._nowait(hashes, run)
            if nowait is not None:
                return nowait
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvc-router-store")
            loop = asyncio.get_running_loop()
            fut = loop.run_in_executor(self._pool, self.query, hashes, run)
            try:
                run = await asyncio.wait_for(asyncio.shield(fut), self.wait_s)
            except TimeoutError:
                pass  # the answer still lands in the cache for the next request
        return Residency(run, self.cached_disk(hashes, run))

    def _nowait(self, hashes: Sequence[bytes | TailRef], start: int) -> Residency | None:
        """The answer from what the store's client maps (:meth:`KVStore.residency_nowait`,
        recorded in the cache), or None: the store is not open or its key layout not yet
        known (both take calls), or it cannot answer without one."""
        store, ks = self._store, self._keyspace
        if store is None or ks is None:
            return None
        res = store.residency_nowait([ks.key_of(h) for h in hashes[start:]])
        if res is None:
            return None
        self.queries += 1
        self.record(hashes, start, res.run, self._clock(), res.disk_only)
        run = start + res.run
        return Residency(run, self.cached_disk(hashes, run))

    async def leading_run(self, hashes: Sequence[bytes | TailRef]) -> int:
        """:meth:`residency`'s run alone."""
        return (await self.residency(hashes)).run

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._store is not None:
            self._store.close()
            self._store = None
