"""The Conductor: prefix knowledge + cost model + bookkeeping -> one decision per request.

Per request: hash the prompt's full blocks once (``kvcentric.hashing``, the connector's
function, so router and store agree on every block), match them against every instance's
resident blocks in one walk (:class:`router.fleet.prefix_index.PrefixIndex`), ask the store view
for the global run, and ask the configured routing policy (``policy:``, default Mooncake's
Algorithm 1: :mod:`kvcentric.router.policies`) for the pair. After dispatch
the chosen instances' bookkeeping (queued prefill time, running decodes, resident blocks,
prefix heat) is updated, and corrected again when the real timings come back.

Runs on the router's event loop only.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from kvcentric.hashing import TailRef, block_hashes, hash_seed, prompt_tail
from kvcentric.router.config import RouterConfig
from kvcentric.router.cost.cost_model import Profile
from kvcentric.router.cost.decision import CostParams, Decision, Rejection
from kvcentric.router.fleet.heat import PrefixHeat
from kvcentric.router.fleet.instances import Registry
from kvcentric.router.fleet.landings import Landings
from kvcentric.router.fleet.prefix_index import PrefixIndex
from kvcentric.router.fleet.store_view import StoreView
from kvcentric.router.policies import RouteInput, make_policy

if TYPE_CHECKING:
    from kvcentric.router.fleet.instances import Instance
    from kvcentric.router.fleet.peers import PeerSync

PEER_PENDING_MAX = 65536  # peers' prefills remembered until their end arrives
# a request held for a landing waits at most this much past twice its predicted wait,
# then goes anyway (its engine finds what is stored by then and computes the rest)
LANDING_SLACK_S = 0.1

log = logging.getLogger("router.cost.decision")


class Conductor:
    def __init__(self, cfg: RouterConfig, profile: Profile, kv_bytes_per_token: int,
                 store: StoreView, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.index = PrefixIndex()
        self.registry = Registry(self.index, cfg.cache.blocks_per_instance,
                                 cfg.cost.shared_compute, cfg.health.log_interval_s)
        self.store = store
        self.heat = PrefixHeat(cfg.cache.heat_half_life_s)
        self.landings: Landings[bytes] = Landings()
        self.profile = profile
        self.kv_bytes_per_token = kv_bytes_per_token
        self.bandwidth = profile.store_bandwidth_bps or cfg.cost.store_bandwidth_gbps * 1e9
        self.disk_bandwidth = profile.disk_bandwidth_bps or cfg.cost.disk_bandwidth_gbps * 1e9
        self.block_size: int | None = None
        # until the engines' page size is known, costs assume 256-token blocks; no prefix
        # is hashed, so no decision counts on a hit it cannot verify
        self.params = CostParams(profile, 256, kv_bytes_per_token * 256, self.bandwidth,
                                 self.disk_bandwidth, cfg.cost.tie_tolerance,
                                 cfg.cost.balance_abs, cfg.cost.balance_rel,
                                 cfg.cost.stall_weight, cfg.cost.work_weight)
        self.clock = clock
        self.policy = make_policy(cfg.policy)
        self.peers: PeerSync | None = None  # set by the app when replicas sync
        self._peer_prefills: OrderedDict[str, Instance] = OrderedDict()
        if cfg.keys.block_size is not None:
            self.set_block_size(cfg.keys.block_size)

    def set_block_size(self, block_size: int) -> None:
        """Fix the stored block size (config, or the engines' default once seen). A change
        drops all prefix knowledge: hashes of another block size name other blocks."""
        if block_size == self.block_size:
            return
        if self.block_size is not None:
            log.warning("stored block size changes %d -> %d: prefix knowledge reset",
                        self.block_size, block_size)
        self.block_size = block_size
        cost = self.cfg.cost
        self.params = CostParams(self.profile, block_size, self.kv_bytes_per_token * block_size,
                                 self.bandwidth, self.disk_bandwidth, cost.tie_tolerance,
                                 cost.balance_abs, cost.balance_rel, cost.stall_weight,
                                 cost.work_weight)
        for inst in self.registry:
            self.index.clear(inst.slot)
            if inst.translator is not None:
                inst.translator.reset(block_size)
        self.store.reset()
        log.info("stored block size: %d tokens", block_size)

    def hashes(self, tokens: np.ndarray | Sequence[int], salt: str | None = None) -> list[bytes]:
        """Chained hashes of the prompt's full blocks (the store keys' last component);
        empty while the block size is unknown."""
        if self.block_size is None:
            return []
        return block_hashes(tokens, self.block_size, self._seed(salt))

    def _seed(self, salt: str | None) -> bytes:
        # not cached: it is one string concatenation, and a cache keyed by the clients'
        # salts (any string, per user or per request) would grow with every one seen
        return hash_seed(self.cfg.model_id, salt)

    def tail(self, tokens: np.ndarray | Sequence[int], hashes: Sequence[bytes],
             salt: str | None = None) -> TailRef | None:
        """The prompt's partial last block (stored by an engine at the end of its prefill,
        loadable so that only the last token is computed); None while the block size is
        unknown or when it holds under 2 tokens."""
        if self.block_size is None:
            return None
        return prompt_tail(tokens, self.block_size, self._seed(salt), hashes)

    async def holds(self, tokens: np.ndarray, salt: str | None = None) -> bool:
        """Whether every full block of ``tokens`` (a prompt's leading tokens) is cached on
        some candidate instance or in the store: a prompt scan
        (:mod:`kvcentric.router.prompt_scan`) goes on while it is. False while the block
        size is unknown (no hash could be matched)."""
        if self.block_size is None:
            return False
        hashes = self.hashes(tokens, salt)
        if not hashes:
            return True
        model = self.cfg.model
        mask = _slots([*self.registry.candidates(model, prefill=True),
                       *self.registry.candidates(model, prefill=False)])
        if max(self.index.match(hashes, mask).values(), default=0) >= len(hashes):
            return True
        return self.store.enabled and await self.store.leading_run(hashes) >= len(hashes)

    def decide_local(self, hashes: Sequence[bytes], n_tokens: int, global_run: int,
                     exclude: Collection[str] = (), global_tail: bool = False,
                     disk_only: Sequence[int] = ()) -> Decision | Rejection:
        """The routing policy's choice given the global run (no I/O); ``global_tail``: the
        store also holds the prompt's tail after all of its blocks; ``disk_only``: ascending
        positions of that run (blocks, then the tail) held only on the store's disk tier.
        With a store, the blocks after that run that in-flight prefills will store are the
        policy's ``landing``."""
        model = self.cfg.model
        pre = [i for i in self.registry.candidates(model, prefill=True) if i.name not in exclude]
        dec = [i for i in self.registry.candidates(model, prefill=False)
               if i.name not in exclude]
        runs = self.index.match(hashes, _slots([*pre, *dec]))
        now = self.clock()
        landing = (self.landings.find(hashes, global_run)
                   if self._landings_on and len(self.landings) else None)
        result = self.policy.choose(RouteInput(
            pre, dec, runs, global_run, n_tokens, self.params, self.cfg.slo, now,
            global_tail, disk_only, hashes[0] if hashes else b"", landing))
        if isinstance(result, Rejection) and result.reason == "no_instance":
            # the client's 503 says why, per instance (URLs only where no API keys are
            # set: keyed clients are tenants, not operators; /instances has them)
            why = self.registry.why_none(model, prefill=True, hide_urls=self.cfg.auth.enabled)
            result = replace(result, message=f"{result.message}: {why}")
        if log.isEnabledFor(logging.DEBUG):
            self._log(result, n_tokens, len(hashes), global_run)
        return result

    async def decide(self, hashes: Sequence[bytes], n_tokens: int,
                     exclude: Collection[str] = (), tail: TailRef | None = None
                     ) -> Decision | Rejection:
        """The routing policy's choice with the store asked (through its TTL cache) for the
        global run of the prompt's blocks and, after them, its tail, and for which of them
        it holds only on disk (one lookup)."""
        if not self.store.enabled:
            return self.decide_local(hashes, n_tokens, 0, exclude)
        items: list[bytes | TailRef] = [*hashes, *([tail] if tail is not None else [])]
        res = await self.store.residency(items)
        return self.decide_local(hashes, n_tokens, min(res.run, len(hashes)), exclude,
                                 res.run > len(hashes), res.disk_only)

    def _log(self, result: Decision | Rejection, n: int, blocks: int, global_run: int) -> None:
        if isinstance(result, Rejection):
            log.debug("reject n=%d blocks=%d global=%d: %s", n, blocks, global_run,
                      result.message)
            return
        cands = ", ".join(f"{c.name}: local={c.local_blocks} q={c.queue_s * 1e3:.1f} "
                          f"load={c.load_s * 1e3:.1f} (disk {c.load_on_disk}) "
                          f"pre={c.prefill_s * 1e3:.1f} ttft={c.ttft_s * 1e3:.1f}ms"
                          for c in result.candidates)
        log.debug("decide n=%d blocks=%d global=%d -> (%s, %s) ttft=%.1fms tbt=%.1fms [%s]",
                  n, blocks, global_run, result.prefill.name, result.decode.name,
                  result.ttft_s * 1e3, result.tbt_s * 1e3, cands)

    # ---- bookkeeping ----
    def dispatched(self, d: Decision, rid: str, hashes: Sequence[bytes],
                   seen_landing: bool = True) -> None:
        """The request was sent: its prefill is queued on p, its decode runs on d, and both
        will hold the prompt's blocks (until the engines' events or the LRU say otherwise).
        ``seen_landing``: :meth:`prefill_finished` will be called when its prefill ends (a
        streamed answer's first chunk, a split pair's prefill answer): only then do the
        blocks it computes count as landing in the store (:attr:`landings`)."""
        now = self.clock()
        d.prefill.enqueue(rid, d.booked_s(now), now)
        d.decode.decodes += 1
        if hashes:
            if d.awaits is None:  # a held request's instance holds nothing until it is sent
                self._resident(d, hashes)
            self.heat.touch(hashes[0], now)
            if seen_landing and self._landings_on and d.prefill.spec.kind == "vllm":
                # SGLang prefills hand their KV to the decode, not (at once) to the store
                self.landings.track(rid, hashes[d.computed_from:], d.prefill_ends(now))
        if self.peers is not None:
            self.peers.announce_dispatch(d, rid, hashes)

    @property
    def _landings_on(self) -> bool:
        """Whether requests may wait for prefixes landing in the store (the config's
        switch, and a store to land in)."""
        return self.cfg.cost.wait_for_landing and self.store.enabled

    async def hold(self, d: Decision, hashes: Sequence[bytes]) -> bool:
        """For a dispatched ``d`` that ``awaits`` a landing: wait until its prefills ended
        (their blocks are in the store), at most twice the predicted wait plus
        :data:`LANDING_SLACK_S`; whether they did. Then the prompt's ``hashes`` count as
        resident on ``d``'s instances: marked at the dispatch, a request sent there
        meanwhile would find them resident, go without waiting, and compute them."""
        assert d.awaits is not None
        left = max(0.0, d.awaits.ready_at - self.clock())
        landed = await self.landings.wait(d.awaits.keys, 2 * left + LANDING_SLACK_S)
        if hashes:
            self._resident(d, hashes)
        return landed

    def resident_beyond_scan(self, d: Decision, rid: str, hashes: Sequence[bytes]) -> None:
        """The whole prompt's block ``hashes`` of request ``rid``, dispatched as ``d``, whose
        prompt scan stopped short (:mod:`kvcentric.router.prompt_scan`): they count as
        resident where :meth:`dispatched` put the scanned ones. Without them the requests
        that share a new prefix and arrive while its first prefill runs see its holder
        hold only the scanned part, predict recomputing the rest there, and recompute the
        prefix on other instances instead. The other router replicas are told
        (:meth:`peer_resident`)."""
        if hashes:
            if d.awaits is None:  # a held request's: marked once it is sent (hold)
                self._resident(d, hashes)
            # what it computes beyond the scanned part lands with it too
            self.landings.extend(rid, hashes[d.computed_from:])
            if self.peers is not None:
                self.peers.announce_resident(d, rid, hashes)

    def _resident(self, d: Decision, hashes: Sequence[bytes]) -> None:
        """Mark ``hashes`` resident on ``d``'s prefill instance and, for a split pair, its
        decode instance; one dropped (or replaced in its slot) since ``d`` gets nothing."""
        if self.registry.get(d.prefill.name) is d.prefill:
            self.index.add(d.prefill.slot, hashes)
        if d.disaggregated and self.registry.get(d.decode.name) is d.decode:
            self.index.add(d.decode.slot, hashes)

    def prefill_finished(self, d: Decision, rid: str, actual_s: float | None) -> None:
        """p finished the prefill (``actual_s`` after dispatch, when known)."""
        p = d.prefill
        now = self.clock()
        p.prefill_done(rid, now)
        stored = self.landings.land(rid)
        if stored:  # saved before the first token left the engine: the store has them
            self.store.record(stored, 0, len(stored), now)
        if self.peers is not None:
            self.peers.announce_done(rid)
        if actual_s is None or not self.cfg.cost.correct_with_actual:
            return
        own = d.own_cost
        if own is not None and own.queue_s == 0.0:  # nothing ahead: actual is load + compute
            raw = own.load_s + own.prefill_s / p.correction
            p.observe(raw, actual_s)

    def finished(self, d: Decision, rid: str) -> None:
        """The request left the decode instance (done, failed or abandoned)."""
        d.prefill.prefill_done(rid, self.clock())
        self.landings.land(rid)  # no-op after prefill_finished
        d.decode.decodes = max(0, d.decode.decodes - 1)
        if self.peers is not None:
            self.peers.announce_done(rid)

    def peer_dispatched(self, key: str, prefill: str, prefill_s: float,
                        hashes: Sequence[bytes]) -> None:
        """Another router replica sent a prefill of ``prefill_s`` predicted seconds to the
        instance named ``prefill`` (:mod:`kvcentric.router.fleet.peers`): its work queues there
        and its blocks count as resident there, as this router's own would. An instance
        this router does not know is ignored."""
        inst = self.registry.get(prefill)
        if inst is None or key in self._peer_prefills:
            return
        now = self.clock()
        inst.enqueue(key, prefill_s, now)
        self._peer_prefills[key] = inst
        if len(self._peer_prefills) > PEER_PENDING_MAX:
            self._peer_prefills.popitem(last=False)
        self.peer_resident(prefill, hashes)
        if hashes and self.block_size is not None:
            self.heat.touch(hashes[0], now)

    def peer_resident(self, prefill: str, hashes: Sequence[bytes]) -> None:
        """Another replica hashed the rest of a prompt it dispatched to the instance
        named ``prefill`` (:meth:`resident_beyond_scan`): the blocks count as resident
        there. An instance this router does not know is ignored."""
        inst = self.registry.get(prefill)
        if inst is not None and hashes and self.block_size is not None:
            self.index.add(inst.slot, hashes)

    def peer_done(self, key: str) -> None:
        """A peer's prefill ended (or its request left)."""
        inst = self._peer_prefills.pop(key, None)
        if inst is not None:
            inst.prefill_done(key, self.clock())

    def replicas(self, h: bytes) -> int:
        """Instances that hold block ``h``."""
        return self.index.owners(h).bit_count()


def _slots(instances: Sequence[Instance]) -> int:
    """The prefix-index mask of ``instances``' slots."""
    mask = 0
    for i in instances:
        mask |= 1 << i.slot
    return mask
