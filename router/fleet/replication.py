"""Hot-prefix replication: warm an idle instance's engine cache with a hot prefix.

Mooncake's Conductor replicates the hottest prefixes so that their requests do not all
queue on the instance that holds them. Here a prefix is named, as in
:class:`router.fleet.heat.PrefixHeat`, by its root block. :class:`HotPrefixes` remembers, for
recently seen roots, the blocks their requests share (the leading run common to every
request seen with that root, with its tokens and cache salt). Every
``replication.interval_s`` the :class:`Replicator` looks at the hottest prefixes and,
where the best holder's predicted TTFT for a request of the prefix is worse than an idle
instance would give if it held the prefix in its engine cache (by more than
``min_gain``), sends that instance a prefill-only request (the prefix, ``max_tokens=1``):
its connector loads the prefix from the store (when the store has it; without a store
it computes it) and its engine cache keeps it for the requests that follow.

Bounds (:class:`router.config.ReplicationConfig`): warm requests in flight, one started
per interval, holders per prefix, one warm-up per (prefix, instance) per cooldown. Warm
requests go only to instances with nothing waiting whose processor has nothing queued,
never to an SGLang prefill server (it serves only a bootstrapped pair)
(on a processor shared with a busy engine a warm-up would slow that engine's prefills:
measured on the CPU comparison, where both engines share the cores), are queued in the cost
model like any prefill (so user requests are routed around them), and are counted in
``kvc_router_warmups``. Runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from kvcentric.router.api.upstream import Upstreams
from kvcentric.router.fleet.instances import Instance

if TYPE_CHECKING:
    from kvcentric.router.conductor import Conductor
    from kvcentric.router.ops.metrics import RouterMetrics

log = logging.getLogger("router.fleet.replication")


@dataclass
class SharedPrefix:
    """The blocks every request seen with one root shared (root first). ``cut``: the
    blocks after these are not known to differ: a request's prompt scan stopped there
    (:mod:`kvcentric.router.prompt_scan`: the next block was held nowhere yet)."""

    hashes: list[bytes]
    tokens: np.ndarray  # the tokens of those blocks
    salt: str | None
    requests: int = 1
    cut: bool = False


class HotPrefixes:
    """Per root block, the prefix its requests share; the ``capacity`` most recently seen
    roots are kept (least recently seen dropped)."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._by_root: OrderedDict[bytes, SharedPrefix] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_root)

    def get(self, root: bytes) -> SharedPrefix | None:
        return self._by_root.get(root)

    def observe(self, hashes: Sequence[bytes], tokens: np.ndarray, salt: str | None,
                block_size: int, cut: bool = False) -> None:
        """Count a request with these full-block ``hashes`` (of ``tokens``, salted with
        ``salt``; ``cut``: its prompt goes on past them, unhashed): its root's shared
        prefix becomes the leading run it has in common with what was shared so far. A
        shared prefix that ended where a scan stopped grows with a request that holds all
        of it and more (the first requests of a prefix stop at its first block, held
        nowhere yet); a request cut within it leaves it whole."""
        if not hashes:
            return
        root = hashes[0]
        p = self._by_root.get(root)
        if p is None:
            self._by_root[root] = SharedPrefix(list(hashes),
                                               np.array(tokens[:len(hashes) * block_size]),
                                               salt, cut=cut)
            if len(self._by_root) > self.capacity:
                self._by_root.popitem(last=False)
            return
        self._by_root.move_to_end(root)
        n = 0
        for a, b in zip(p.hashes, hashes):
            if a != b:
                break
            n += 1
        if n == len(p.hashes) and p.cut and len(hashes) > n:
            p.hashes = list(hashes)
            p.tokens = np.array(tokens[:len(hashes) * block_size])
            p.cut = cut
        elif n < len(p.hashes) and not (cut and n == len(hashes)):
            p.hashes = p.hashes[:n]
            p.tokens = p.tokens[:n * block_size]
            p.cut = False
        p.requests += 1


@dataclass(frozen=True)
class Warmup:
    """A decision to warm ``target`` with ``prefix``; TTFTs predicted for a request of the
    prefix (its blocks reused, one more block computed)."""

    target: Instance
    prefix: SharedPrefix
    holder_ttft_s: float
    target_ttft_s: float


class Replicator:
    def __init__(self, conductor: Conductor, metrics: RouterMetrics,
                 client: Upstreams | httpx.AsyncClient | None = None) -> None:
        self.conductor = conductor
        self.cfg = conductor.cfg.replication
        self.metrics = metrics
        self.client = client
        self.prefixes = HotPrefixes()
        self.inflight: set[str] = set()  # instance names being warmed
        self._warmed: dict[tuple[bytes, str], float] = {}  # (root, instance) -> when
        self._tasks: set[asyncio.Task[None]] = set()

    def observe(self, hashes: Sequence[bytes], tokens: np.ndarray, salt: str | None,
                cut: bool = False) -> None:
        """A user request was routed (called for every one while replication is on);
        ``cut``: its prompt scan stopped after ``tokens``."""
        if self.cfg.enabled and self.conductor.block_size is not None:
            self.prefixes.observe(hashes, tokens, salt, self.conductor.block_size, cut)

    # ---- deciding (no I/O) ----
    def candidates(self, now: float) -> list[Warmup]:
        """Warm-ups worth starting now, best gain first (at most one per prefix)."""
        if self.conductor.block_size is None:
            return []
        out = []
        for root, heat in self.conductor.heat.top(self.cfg.top_prefixes, now):
            if heat < self.cfg.min_heat:
                break
            p = self.prefixes.get(root)
            if p is None or p.requests < 2 or not p.hashes:
                continue
            w = self.pick(root, p, now)
            if w is not None:
                out.append(w)
        out.sort(key=lambda w: w.target_ttft_s / w.holder_ttft_s)
        return out

    def pick(self, root: bytes, p: SharedPrefix, now: float) -> Warmup | None:
        """The idle instance that would serve ``p``'s requests best if it held ``p``,
        when that beats the best holder by more than ``min_gain``; else None."""
        c = self.conductor
        # an SGLang prefill server takes a request only with a bootstrap room, paired with
        # its decode: a plain prefill-only request would be refused, never warm anything
        cands = [i for i in c.registry.candidates(c.cfg.model, prefill=True)
                 if not i.spec.sglang_prefill]
        mask = 0
        for i in cands:
            mask |= 1 << i.slot
        runs = c.index.match(p.hashes, mask)
        held = len(p.hashes)
        holders = [i for i in cands if runs.get(i.slot, 0) >= held]
        if not holders or len(holders) >= self.cfg.max_replicas:
            return None
        n = (held + 1) * c.params.block_size
        hit = held * c.params.block_size

        def ttft(i: Instance) -> float:
            work = c.profile.prefill_s(n, hit) * i.correction
            return i.queue_s(now, work) + work

        best_holder = min(ttft(h) for h in holders)
        best: tuple[float, Instance] | None = None
        for i in cands:
            # idle capacity: nothing queued on the whole processor (a warm-up on an
            # engine sharing cores or a GPU with a busy one would slow its prefills)
            if (runs.get(i.slot, 0) >= held or i.name in self.inflight
                    or not i.proc.idle(now) or i.stats.waiting > 0
                    or now - self._warmed.get((root, i.name), -1e18) < self.cfg.cooldown_s):
                continue
            t = ttft(i)
            if best_holder > t * (1 + self.cfg.min_gain) and (best is None or t < best[0]):
                best = (t, i)
        if best is None:
            return None
        return Warmup(best[1], p, best_holder, best[0])

    # ---- acting ----
    async def run(self) -> None:
        """The loop: one warm-up started per interval at most."""
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                await self.step()
            except Exception:  # noqa: BLE001 -- replication is best effort, never fatal
                log.exception("replication step failed")

    async def step(self) -> Warmup | None:
        """Start the best warm-up now, if any is due and allowed; returns it."""
        if len(self.inflight) >= self.cfg.max_inflight:
            return None
        now = self.conductor.clock()
        for w in self.candidates(now):
            if self.conductor.store.enabled:
                res = await self.conductor.store.residency(w.prefix.hashes)
                if res.run < len(w.prefix.hashes):
                    continue  # a warm-up loads from the store; it would compute instead
            self._start(w, now)
            return w
        return None

    def _start(self, w: Warmup, now: float) -> None:
        name = w.target.name
        self.inflight.add(name)
        self._warmed[(w.prefix.hashes[0], name)] = now
        if len(self._warmed) > 4096:  # forget cooldowns long over
            self._warmed = {k: t for k, t in self._warmed.items()
                            if now - t < self.cfg.cooldown_s}
        task = asyncio.get_running_loop().create_task(self._warm(w))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _warm(self, w: Warmup) -> None:
        c, inst = self.conductor, w.target
        rid = f"warm-{uuid.uuid4().hex}"
        n = len(w.prefix.tokens)
        pred = c.params.load_time_s(len(w.prefix.hashes)) + \
            c.profile.prefill_s(n, n - 1) * inst.correction
        inst.enqueue(rid, pred, c.clock())
        log.info("warming %s with a hot prefix of %d blocks (predicted TTFT %.0f ms on its "
                 "best holder, %.0f ms there once held)", inst.name, len(w.prefix.hashes),
                 w.holder_ttft_s * 1e3, w.target_ttft_s * 1e3)
        ok = False
        try:
            assert self.client is not None
            r = await self.client.post(inst.spec.url + "/v1/completions",
                                       json=warm_body(c.cfg.model, w.prefix))
            ok = r.status_code == 200
            if not ok:
                log.warning("warming %s failed: HTTP %d %s", inst.name, r.status_code,
                            r.text[:200])
        except httpx.HTTPError as exc:
            log.warning("warming %s failed: %s", inst.name, exc)
        finally:
            inst.prefill_done(rid, c.clock())
            self.inflight.discard(inst.name)
        if ok:
            c.index.add(inst.slot, w.prefix.hashes)
        self.metrics.warmups.labels("ok" if ok else "failed").inc()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def warm_body(model: str, p: SharedPrefix) -> dict[str, Any]:
    """The prefill-only request that puts ``p`` in an engine's cache: its tokens as the
    prompt, one greedy token, the same cache salt (the salt is part of every block's
    hash: without it the engine would cache other blocks)."""
    body: dict[str, Any] = {"model": model, "prompt": [int(t) for t in p.tokens],
                            "max_tokens": 1, "temperature": 0.0}
    if p.salt is not None:
        body["cache_salt"] = p.salt
    return body
