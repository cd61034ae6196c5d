"""Discrete-event model of a P/D cluster with per-instance KV caches and a global store.

Used by :mod:`benchmarks.sim.routing`. Units: seconds, tokens, blocks of ``BLOCK`` = 512 tokens
(the Mooncake traces' hash_ids granularity).

Physics, the same for every policy:

- A prefill instance runs one prefill at a time, first come first served. Its prompt's
  reusable prefix is the longer of the leading run in the instance's own cache (HBM: no
  transfer) and the leading run in the global store (loaded at ``store_bw``). Time =
  ``T_prefill(n, hit) + T_load`` from the profile, times a lognormal noise factor the
  router cannot predict. The prompt's full blocks enter the instance's LRU cache when
  it is dispatched there (FIFO: they exist before any later request on it starts) and
  the store's LRU when the prefill ends (a block is visible only once committed).
- The prompt's KV then moves to a decode instance (full prompt at ``store_bw``), which
  admits it when its KV capacity allows; TBT = ``tbt_base + tbt_per_seq * batch`` at
  admission; first token one TBT after admission. TTFT = first token - arrival.
- A request meets the SLO when TTFT <= ``slo_ttft`` and TBT <= ``slo_tbt``. Refused
  requests count as misses.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

BLOCK = 512


@dataclass(frozen=True)
class Request:
    t: float
    n: int
    out: int
    blocks: tuple[int, ...]  # reusable full blocks (hash ids)


@dataclass(frozen=True)
class SimConfig:
    prefill: int = 8
    decode: int = 4
    local_blocks: int = 320        # per prefill instance (HBM prefix cache)
    store_blocks: int = 16384      # global store (pooled DRAM)
    store_bw: float = 25e9         # bytes/s from the store tier
    kv_bytes_per_token: int = 131072
    a: float = 2.5e-9              # prefill fit: a (n^2 - h^2) + b (n - h) + c
    b: float = 1.0 / 12000
    c: float = 0.02
    tbt_base: float = 0.02
    tbt_per_seq: float = 0.0002
    decode_tokens: int = 480_000   # KV capacity of one decode instance
    slo_ttft: float = 5.0
    slo_tbt: float = 0.1
    noise: float = 0.1             # sigma of the lognormal factor on real prefill times
    seed: int = 0

    def prefill_s(self, n: int, hit_tokens: int) -> float:
        h = min(hit_tokens, n - 1)
        return self.a * (n * n - h * h) + self.b * (n - h) + self.c

    def load_s(self, blocks: int) -> float:
        return blocks * BLOCK * self.kv_bytes_per_token / self.store_bw

    def tbt(self, batch: int) -> float:
        return self.tbt_base + self.tbt_per_seq * batch


class LRU:
    """Blocks by id, least recently used first; a chain is touched leaf-first so roots
    outlive their descendants."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.d: OrderedDict[int, None] = OrderedDict()

    def run(self, blocks: Sequence[int]) -> int:
        n = 0
        for b in blocks:
            if b not in self.d:
                break
            n += 1
        return n

    def add(self, blocks: Sequence[int]) -> None:
        d = self.d
        for b in reversed(blocks):
            if b in d:
                d.move_to_end(b)
            else:
                d[b] = None
        while len(d) > self.capacity:
            d.popitem(last=False)


@dataclass
class Prefiller:
    cache: LRU
    busy_until: float = 0.0

    def queue(self, now: float) -> float:
        return max(0.0, self.busy_until - now)


@dataclass
class Decoder:
    active: list[tuple[float, int]] = field(default_factory=list)  # heap (finish, tokens)
    tokens: int = 0

    def purge(self, now: float) -> None:
        while self.active and self.active[0][0] <= now:
            self.tokens -= heapq.heappop(self.active)[1]

    def batch(self, now: float) -> int:
        self.purge(now)
        return len(self.active)


@dataclass
class Outcome:
    ttft: float | None  # None: refused
    tbt: float
    hit_tokens: int
    local_tokens: int
    n: int
    met: bool


class Cluster:
    """One policy's run over a trace."""

    def __init__(self, cfg: SimConfig, policy: str) -> None:
        self.cfg = cfg
        self.policy = policy
        self.rnd = random.Random(cfg.seed)
        self.noise = random.Random(cfg.seed + 1)
        self.use_store = policy != "local_cache_aware"
        local = cfg.local_blocks
        if not self.use_store:  # equal total capacity: the store's share, but private
            local += cfg.store_blocks // cfg.prefill
        self.pre = [Prefiller(LRU(local)) for _ in range(cfg.prefill)]
        self.dec = [Decoder() for _ in range(cfg.decode)]
        self.store = LRU(cfg.store_blocks)
        self.rr = 0
        self.rr_d = 0

    # ---- policy: which prefill instance (None: refuse) ----
    def choose(self, r: Request, now: float) -> int | None:
        pol, pre = self.policy, self.pre
        if pol == "random":
            return self.rnd.randrange(len(pre))
        if pol == "round_robin":
            self.rr = (self.rr + 1) % len(pre)
            return self.rr
        if pol == "least_load":
            return min(range(len(pre)), key=lambda i: pre[i].queue(now))
        if pol == "local_cache_aware":
            return self._cache_aware(r, now)
        return self._algorithm1(r, now, reject=pol == "kvcentric")

    def _cache_aware(self, r: Request, now: float) -> int:
        """SGLang-router style: longest local prefix unless loads are imbalanced or the
        best match is short, then the least loaded instance."""
        pre = self.pre
        loads = [p.queue(now) for p in pre]
        least = min(range(len(pre)), key=loads.__getitem__)
        if max(loads) - min(loads) > self.cfg.slo_ttft / 2:
            return least
        runs = [p.cache.run(r.blocks) for p in pre]
        best = max(range(len(pre)), key=lambda i: (runs[i], -loads[i]))
        if not r.blocks or runs[best] < 0.5 * len(r.blocks):
            return least
        return best

    def _algorithm1(self, r: Request, now: float, reject: bool) -> int | None:
        cfg = self.cfg
        g = self.store.run(r.blocks)
        best, best_t, best_q = 0, math.inf, 0.0
        for i, p in enumerate(self.pre):
            local = p.cache.run(r.blocks)
            q = p.queue(now)
            t = q + cfg.load_s(max(0, g - local)) + cfg.prefill_s(r.n, max(local, g) * BLOCK)
            if t < best_t:
                best, best_t, best_q = i, t, q
        if reject:
            # refuse only what load makes late: a request too long for the SLO even on an
            # idle instance is served (refusing it would not help, and retrying never would)
            ttft = best_t + cfg.load_s(len(r.blocks)) + min(
                cfg.tbt(d.batch(now) + 1) for d in self.dec)
            if ttft > cfg.slo_ttft and ttft - best_q <= cfg.slo_ttft:
                return None
        return best

    def choose_decode(self, need: int, now: float) -> int:
        if self.policy == "random":
            return self.rnd.randrange(len(self.dec))
        if self.policy == "round_robin":
            self.rr_d = (self.rr_d + 1) % len(self.dec)
            return self.rr_d
        for d in self.dec:
            d.purge(now)
        fits = [i for i, d in enumerate(self.dec) if d.tokens + need <= self.cfg.decode_tokens]
        pool = fits or list(range(len(self.dec)))
        return min(pool, key=lambda i: (self.dec[i].batch(now), self.dec[i].tokens))

    # ---- the run ----
    def run(self, reqs: Sequence[Request]) -> list[Outcome]:
        cfg = self.cfg
        out: list[Outcome | None] = [None] * len(reqs)
        events: list[tuple[float, int, int, int]] = []  # (time, kind, seq, req index)
        for i, r in enumerate(reqs):
            heapq.heappush(events, (r.t, 2, i, i))  # arrivals after same-time completions
        seq = len(reqs)
        pending: dict[int, tuple[int, int]] = {}  # req -> (hit tokens, local tokens)
        while events:
            now, kind, _, i = heapq.heappop(events)
            r = reqs[i]
            if kind == 0:  # prefill done: commit its blocks to the store
                if self.use_store:
                    self.store.add(r.blocks)
                continue
            if kind == 1:  # KV reached decode: admit, first token
                out[i] = self._admit(r, i, now, pending.pop(i))
                continue
            p_idx = self.choose(r, now)
            if p_idx is None:
                out[i] = Outcome(None, 0.0, 0, 0, r.n, False)
                continue
            p = self.pre[p_idx]
            local = p.cache.run(r.blocks)
            g = self.store.run(r.blocks) if self.use_store else 0
            if g:
                self.store.add(r.blocks[:g])  # a read refreshes the store's LRU
            hit = max(local, g)
            dur = (cfg.prefill_s(r.n, hit * BLOCK) + cfg.load_s(max(0, g - local))) \
                * math.exp(self.noise.gauss(0.0, cfg.noise))
            start = max(now, p.busy_until)
            p.busy_until = start + dur
            p.cache.add(r.blocks)
            heapq.heappush(events, (p.busy_until, 0, seq, i))
            heapq.heappush(events, (p.busy_until + cfg.load_s(len(r.blocks)), 1, seq + 1, i))
            seq += 2
            pending[i] = (min(hit * BLOCK, r.n), min(local * BLOCK, r.n))
        return [o for o in out if o is not None]

    def _admit(self, r: Request, i: int, now: float, hits: tuple[int, int]) -> Outcome:
        need = r.n + r.out
        d = self.dec[self.choose_decode(need, now)]
        d.purge(now)
        t = now
        while d.active and d.tokens + need > self.cfg.decode_tokens:
            fin, toks = heapq.heappop(d.active)  # wait for room
            d.tokens -= toks
            t = max(t, fin)
        tbt = self.cfg.tbt(len(d.active) + 1)
        heapq.heappush(d.active, (t + r.out * tbt, need))
        d.tokens += need
        ttft = t + tbt - r.t
        met = ttft <= self.cfg.slo_ttft and tbt <= self.cfg.slo_tbt
        return Outcome(ttft, tbt, hits[0], hits[1], r.n, met)
