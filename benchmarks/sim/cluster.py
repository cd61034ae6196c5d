"""Discrete-event model of a P/D cluster with per-instance KV caches and a global store,
routed by the router's own policies (:mod:`kvcentric.router.policies`).

Used by :mod:`benchmarks.sim.routing`. Units: seconds, tokens, blocks of ``BLOCK`` = 512 tokens
(the Mooncake traces' hash_ids granularity).

Physics, the same for every policy:

- A prefill instance runs one prefill at a time, first come first served. Its prompt's
  reusable prefix is the longer of the leading run in the instance's own cache (HBM: no
  transfer) and the leading run in the global store (loaded at ``store_bw`` from its
  DRAM tier, at ``disk_bw`` from its disk tier when ``disk_blocks`` > 0). Time =
  ``T_prefill(n, hit) + T_load`` from the profile, times a lognormal noise factor the
  router cannot predict. The prompt's full blocks enter the instance's LRU cache when
  it is dispatched there (FIFO: they exist before any later request on it starts) and
  the store's DRAM LRU when the prefill ends (a block is visible only once committed);
  what DRAM evicts goes to the disk tier, what is read from disk back to DRAM.
- A request the router holds for a prefix in flight (its decision ``awaits`` a landing,
  :mod:`kvcentric.router.fleet.landings`) reaches its prefill instance only when the
  prefills it waits for end (the proxy holds it until then; the hold's time bound is
  not modelled), then queues there like any request and loads what they stored.
- The prompt's KV then moves to a decode instance (full prompt at ``store_bw``), which
  admits it when its KV capacity allows; TBT = ``tbt_base + tbt_per_seq * batch`` at
  admission; first token one TBT after admission. TTFT = first token - arrival.
- A request meets the SLO when TTFT <= ``slo_ttft`` and TBT <= ``slo_tbt``. Refused
  requests count as misses.

Routing is the router's code, not a copy: each arm (:data:`ARMS`) names a registered
policy, which sees what the Conductor would (:meth:`Cluster.choose`): every prefill
instance's engine-cache run and the store's run, the prefill queues as the router's
bookkeeping predicts them (not the true, noisy ones), the decoders' running sequences and
KV usage; it picks the prefill instance and the decoder the KV goes to, or refuses.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcentric.router.config import SloConfig
from kvcentric.router.cost.cost_model import Profile
from kvcentric.router.cost.decision import CostParams, Decision, Rejection
from kvcentric.router.fleet.instance_spec import InstanceSpec
from kvcentric.router.fleet.instances import Instance
from kvcentric.router.fleet.landings import Landings
from kvcentric.router.policies import RouteInput, make_policy

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
    disk_blocks: int = 0           # the store's disk tier under its DRAM (0: none)
    disk_bw: float = 3e9           # bytes/s from the disk tier (a node's NVMe)
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

    def load_s(self, blocks: int, on_disk: int = 0) -> float:
        """``blocks`` from the store, ``on_disk`` of them from its disk tier."""
        per = BLOCK * self.kv_bytes_per_token
        return (blocks - on_disk) * per / self.store_bw + on_disk * per / self.disk_bw

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

    def add(self, blocks: Sequence[int]) -> list[int]:
        """Insert or refresh ``blocks``; the ids evicted to make room."""
        d = self.d
        for b in reversed(blocks):
            if b in d:
                d.move_to_end(b)
            else:
                d[b] = None
        evicted = []
        while len(d) > self.capacity:
            evicted.append(d.popitem(last=False)[0])
        return evicted


class TieredStore:
    """The global store: a DRAM LRU over a disk LRU (``disk_blocks`` 0: DRAM only). What
    DRAM evicts is demoted to disk, what is read from disk is promoted back to DRAM (the
    local store's write-back tier and its reads' settle, at block granularity)."""

    def __init__(self, dram_blocks: int, disk_blocks: int) -> None:
        self.dram = LRU(dram_blocks)
        self.disk = LRU(disk_blocks) if disk_blocks > 0 else None

    def run(self, blocks: Sequence[int]) -> int:
        n = 0
        for b in blocks:
            if b not in self.dram.d and (self.disk is None or b not in self.disk.d):
                break
            n += 1
        return n

    def disk_only(self, blocks: Sequence[int], run: int) -> list[int]:
        """Positions among the first ``run`` blocks held on disk only (ascending)."""
        return [i for i in range(run) if blocks[i] not in self.dram.d]

    def add(self, blocks: Sequence[int]) -> None:
        """Store (or read, which promotes) ``blocks``: into DRAM, demoting what it evicts."""
        if self.disk is not None:
            for b in blocks:
                self.disk.d.pop(b, None)
        demoted = self.dram.add(blocks)
        if self.disk is not None and demoted:
            self.disk.add(demoted[::-1])  # the most recently used of them last


@dataclass
class Prefiller:
    cache: LRU
    busy_until: float = 0.0  # the true queue, which the router only predicts


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


@dataclass(frozen=True)
class Arm:
    """One compared arm: ``policy``, a routing policy of the router's registry
    (:data:`kvcentric.router.policies.POLICIES`), on a cluster with the global store
    (``store``; without it each prefill instance gets the store's share as private cache)
    and refusing predicted SLO misses (``reject``, the router's ``slo.reject``);
    ``tier_aware``: the router knows the disk tier's bandwidth (else it prices every
    stored block at the DRAM tier's, as a router blind to tiers would)."""

    policy: str
    store: bool = True
    reject: bool = False
    tier_aware: bool = True  # False: the router prices disk-tier loads as DRAM ones
    landings: bool = False  # with the store: prefixes in flight may be waited for


ARMS = {
    "random": Arm("random"),
    "round_robin": Arm("round_robin"),
    "least_load": Arm("least_loaded"),
    # the paper's Figure 5 baselines: no global pool, each instance reuses its own cache
    "random_nostore": Arm("random", store=False),
    "round_robin_nostore": Arm("round_robin", store=False),
    "least_load_nostore": Arm("least_loaded", store=False),
    "local_cache_aware": Arm("engine_cache", store=False),
    # a peer's cache-aware router in front of engines that share our store
    "engine_cache_store": Arm("engine_cache"),
    "kvcentric": Arm("algorithm1", reject=True),
    "kvcentric_noreject": Arm("algorithm1"),
    # the same with landings (cost.wait_for_landing: true)
    "kvcentric_noreject_landing": Arm("algorithm1", landings=True),
    # the same without the store: engine caches only (where a hot prefix can hot-spot)
    "kvcentric_nostore": Arm("algorithm1", store=False, reject=True),
    "kvcentric_noreject_nostore": Arm("algorithm1", store=False),
    # the same, blind to the store's tiers (with a disk tier: SimConfig.disk_blocks > 0)
    "kvcentric_tierblind": Arm("algorithm1", reject=True, tier_aware=False),
    "kvcentric_noreject_tierblind": Arm("algorithm1", tier_aware=False),
}


@dataclass
class Pending:
    """A dispatched request until its KV reaches its decoder."""

    decision: Decision
    dispatched: float
    hit_tokens: int
    local_tokens: int


class Cluster:
    """One arm's run over a trace: the router's policy decides on the router's view of the
    cluster, the physics above serves what it decided."""

    def __init__(self, cfg: SimConfig, arm: str) -> None:
        self.cfg = cfg
        self.arm = ARMS[arm]
        self.policy = make_policy(self.arm.policy, random.Random(cfg.seed))
        self.noise = random.Random(cfg.seed + 1)
        self.use_store = self.arm.store
        local = cfg.local_blocks
        if not self.use_store:  # equal total capacity: the store's share, but private
            local += cfg.store_blocks // cfg.prefill
        self.pre = [Prefiller(LRU(local)) for _ in range(cfg.prefill)]
        self.dec = [Decoder() for _ in range(cfg.decode)]
        self.store = TieredStore(cfg.store_blocks, cfg.disk_blocks)
        # the router's view: its cost model is the physics' own (its TBT counts the batch
        # from 1: tbt(batch) here is tbt_base_s + tbt_per_seq_s * (batch - 1) there)
        profile = Profile(a=cfg.a, b=cfg.b, c=cfg.c, tbt_base_s=cfg.tbt_base + cfg.tbt_per_seq,
                          tbt_per_seq_s=cfg.tbt_per_seq)
        self.params = CostParams(profile, BLOCK, BLOCK * cfg.kv_bytes_per_token, cfg.store_bw,
                                 cfg.disk_bw if self.arm.tier_aware else None)
        self.slo = SloConfig(ttft_ms=cfg.slo_ttft * 1000, tbt_ms=cfg.slo_tbt * 1000,
                             reject=self.arm.reject)
        self.p_inst = [_instance(f"p{k}", k, "prefill") for k in range(cfg.prefill)]
        self.d_inst = [_instance(f"d{j}", cfg.prefill + j, "decode") for j in range(cfg.decode)]
        self.to_admit = [0] * cfg.decode  # routed to decoder j, KV not there yet
        # the Conductor's table of prefixes in flight (kvcentric.router.fleet.landings),
        # and when each in-flight prefill really ends (a held request starts then)
        self.landings: Landings[int] = Landings()
        self.use_landings = self.use_store and self.arm.landings
        # held requests: by the in-flight request each waits for, and what each still
        # waits for (released, as the proxy releases them, when those prefills end)
        self.waiting: dict[str, list[int]] = {}
        self.held: dict[int, set[str]] = {}

    # ---- the router: its policy over its view of the cluster ----
    def choose(self, r: Request, now: float) -> Decision | Rejection:
        """The router's decision for ``r``: engine-cache runs and the store's run as the
        prefix view, prefill queues as the router's bookkeeping predicts them (enqueued at
        dispatch, done when the prefill ends, as the Conductor does), decoders' running
        sequences and KV usage as an engine's gauges report them."""
        cfg = self.cfg
        runs = {inst.slot: p.cache.run(r.blocks) for inst, p in zip(self.p_inst, self.pre)}
        for j, (inst, d) in enumerate(zip(self.d_inst, self.dec)):
            running = d.batch(now)
            inst.stats.running = running
            inst.stats.kv_usage = d.tokens / cfg.decode_tokens
            inst.decodes = running + self.to_admit[j]
        g = self.store.run(r.blocks) if self.use_store else 0
        # the first block's id stands for its hash (the router's affinity)
        affinity = str(r.blocks[0]).encode() if r.blocks else b""
        landing = (self.landings.find(r.blocks, g)
                   if self.use_landings and len(self.landings) else None)
        return self.policy.choose(RouteInput(self.p_inst, self.d_inst, runs, g, r.n,
                                             self.params, self.slo, now,
                                             disk_only=self.store.disk_only(r.blocks, g),
                                             affinity=affinity, landing=landing))

    # ---- the run ----
    def run(self, reqs: Sequence[Request]) -> list[Outcome]:
        cfg = self.cfg
        out: list[Outcome | None] = [None] * len(reqs)
        events: list[tuple[float, int, int, int]] = []  # (time, kind, seq, req index)
        for i, r in enumerate(reqs):
            heapq.heappush(events, (r.t, 2, i, i))  # arrivals after same-time completions
        seq = len(reqs)
        pending: dict[int, Pending] = {}
        while events:
            now, kind, _, i = heapq.heappop(events)
            r = reqs[i]
            if kind == 0:  # prefill done: commit its blocks to the store
                if self.use_store:
                    self.store.add(r.blocks)
                self.landings.land(str(i))
                self._prefill_done(pending[i], str(i), now)
                for j in self.waiting.pop(str(i), ()):
                    self.held[j].discard(str(i))
                    if not self.held[j]:
                        del self.held[j]
                        seq = self._start(reqs[j], j, pending[j], now, events, seq)
                continue
            if kind == 1:  # KV reached decode: admit, first token
                out[i] = self._admit(r, now, pending.pop(i))
                continue
            d = self.choose(r, now)
            if isinstance(d, Rejection):
                out[i] = Outcome(None, 0.0, 0, 0, r.n, False)
                continue
            d.prefill.enqueue(str(i), d.booked_s(now), now)
            if self.use_landings:
                self.landings.track(str(i), r.blocks[d.computed_from:], d.prefill_ends(now))
            self.to_admit[d.decode.slot - cfg.prefill] += 1
            pending[i] = Pending(d, now, 0, 0)
            awaited = {k for k in d.awaits.keys if self.landings.tracked(k)} if d.awaits else ()
            if awaited:  # held until the prefills it waits for stored their blocks
                self.held[i] = set(awaited)
                for k in awaited:
                    self.waiting.setdefault(k, []).append(i)
                continue
            seq = self._start(r, i, pending[i], now, events, seq)
        return [o for o in out if o is not None]

    def _start(self, r: Request, i: int, pend: Pending, now: float,
               events: list[tuple[float, int, int, int]], seq: int) -> int:
        """Request ``i`` reaches its prefill instance at ``now``: it queues there (FIFO)
        and finds what that instance's cache and the store hold then; schedules its
        prefill's end and its KV's arrival at the decoder. Returns the next event number."""
        cfg = self.cfg
        p = self.pre[pend.decision.prefill.slot]
        local = p.cache.run(r.blocks)
        g = self.store.run(r.blocks) if self.use_store else 0
        on_disk = sum(b >= local for b in self.store.disk_only(r.blocks, g))
        if g:  # a read refreshes the LRU, promotes from disk
            self.store.add(r.blocks[:g])
        hit = max(local, g)
        dur = (cfg.prefill_s(r.n, hit * BLOCK) + cfg.load_s(max(0, g - local), on_disk)) \
            * math.exp(self.noise.gauss(0.0, cfg.noise))
        p.busy_until = max(now, p.busy_until) + dur
        p.cache.add(r.blocks)
        heapq.heappush(events, (p.busy_until, 0, seq, i))
        heapq.heappush(events, (p.busy_until + cfg.load_s(len(r.blocks)), 1, seq + 1, i))
        pend.hit_tokens, pend.local_tokens = min(hit * BLOCK, r.n), min(local * BLOCK, r.n)
        return seq + 2

    def _prefill_done(self, pend: Pending, rid: str, now: float) -> None:
        """What the Conductor does when a prefill's answer comes back: its queued work
        leaves, and with nothing predicted ahead of it its time corrects the profile."""
        d = pend.decision
        p = d.prefill
        p.prefill_done(rid, now)
        own = d.own_cost
        if own is not None and own.queue_s == 0.0:
            p.observe(own.load_s + own.prefill_s / p.correction, now - pend.dispatched)

    def _admit(self, r: Request, now: float, pend: Pending) -> Outcome:
        need = r.n + r.out
        j = pend.decision.decode.slot - self.cfg.prefill
        self.to_admit[j] -= 1
        d = self.dec[j]
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
        return Outcome(ttft, tbt, pend.hit_tokens, pend.local_tokens, r.n, met)


def _instance(name: str, slot: int, role: str) -> Instance:
    return Instance(InstanceSpec(url=f"http://{name}:1", role=role, name=name), slot)
