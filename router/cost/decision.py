"""Mooncake's Algorithm 1: pick the (prefill, decode) pair with the lowest predicted TTFT.

For every prefill candidate ``p``::

    TTFT_p = T_queue(p) + T_load(global − local_p) + T_prefill(n, max(local_p, global))

where ``local_p`` is the leading run of the prompt's blocks resident on ``p`` and ``global``
the run in the store. ``T_load`` of store objects is ``dram_bytes / store bandwidth +
disk_bytes / disk bandwidth``: objects the store holds only on its disk tier (``disk_only``,
positions from :meth:`kvcentric.store.KVStore.batch_residency`) load at the disk's
bandwidth, the rest at the DRAM tier's. A ``both`` instance decodes
what it prefilled; a ``prefill`` instance hands over to the decode instance ``d`` that loads
the prompt's KV from the store fastest and whose predicted TBT (running batch, KV usage)
is lowest, adding ``T_load(prompt − local_d)`` and one decode step (decoders within the
tie tolerance of that go by fewer running decodes). Pairs breaking the TBT
SLO are never chosen; if the best pair's TTFT breaks the TTFT SLO because of queueing the
request is refused (HTTP 429 with ``Retry-After``: the time for the predicted queue to
drain by the excess), unless ``slo.reject`` is off (then it is served, flagged
``over_slo``). ``T_queue`` is the instance's own queued prefill work plus what busy
instances on the same processor (``compute``) take of it meanwhile (fair share, see
:class:`router.fleet.instances.Processor`); the profile's correction is per processor; ties go
to the instance running fewer sequences.
Predictions closer than ``tie_tolerance`` (relative) to the lowest are ties: the model
cannot tell them apart (its per-processor corrections and load times are estimates a few
percent off), and taking the lowest would send every request to whichever instance's
correction happens to be a little lower, and then queue them there; among ties the
instance with the least queued prefill work wins, then the one running fewer sequences.
With an ``affinity`` (the prompt's first block hash), ties on separate processors among
instances none of which holds the prompt's first block go instead to the instance ranked
first for it by rendezvous hashing: several router replicas, each seeing only part of the
fleet's load, then agree where a prefix not yet resident anywhere goes, instead of each
computing it on a different instance. Once some tied instance holds it, load decides
again: ranking every tie sent each hot prefix's requests to the same few engines, whose
running decodes then waited on the newcomers' prefill chunks (TPOT far worse than
round-robin's in the emulated hot-prefix runs, benchmarks/results/).
Algorithm 1 is greedy, so a load bound (``CostParams.balance_abs``/``balance_rel``,
:func:`overloaded`) comes first: a candidate running far more sequences than the least
loaded one, in both absolute and relative terms, is left out, else a hot prefix's holders
(always the lowest prediction next to recomputing the prefix elsewhere) took every request
while their decodes slowed each prefill they took and engines without the prefix idled.
On a colocated (``both``) instance a prefill shares the engine's steps with the sequences
decoding there: each of its chunked steps is a long gap in their token streams, so a
prefill placed beside them costs each about its compute time (the TBT that the paper's
SLO counts). The choice therefore minimises a pair's *score*: its TTFT plus
``stall_weight`` times this router's requests on ``p`` (all of them decode while it runs:
those still prefilling are ahead of it in the queue) times the prefill's compute and
load on ``p`` (a colocated instance loads store hits inside the step, the connector's
default there); the request's own wait plus the wait it inflicts. A long uncached
prefill goes where no decode waits on it, and one mostly cached (little compute) still
goes to its prefix; one whose prefix is in the store goes where it is already resident
rather than load it beside decodes of an engine a little less busy (counting compute
alone spread a hot prefix's requests over engines that each loaded it, and their decodes
missed the TBT SLO). Only pairs that meet the TTFT SLO compete on the score when any
does; when none does the lowest TTFT is taken. ``stall_weight`` 0 is the TTFT alone;
the emulated capacity sweeps compare the two (``kvcentric-ttft_only``,
benchmarks/results/).
The score also charges the request's own work on ``p`` (its load and compute, which hold
the engine's steps, times ``work_weight``): the fleet's capacity it takes from the
requests after it. While a new prefix's first prefill still runs on its holder, the
prefix's next requests see the holder hold it (the router marks it resident at the
dispatch) behind that prefill; on TTFT alone an idle instance recomputing the whole
prefix finishes a little sooner, so each of them computed it cold elsewhere. Charged its
work, a request waits for the holder until the holder's queue costs more than a cold
prefill twice over; a prefix hot enough to queue more than that during its first prefill
still spreads (the store holds it only once that prefill ends: emulated hot-prefix runs,
benchmarks/results/).
While a prefix's first prefill still runs, the store does not hold it yet; a
``landing`` (:mod:`kvcentric.router.fleet.landings`) says which blocks it will store and
when. A candidate that would otherwise compute them may instead wait for it, then load
them (:func:`prefill_cost`: its queue is at least the wait, and it takes that option when
it scores lower); the decision ``awaits`` the landing and the proxy holds the request
until it is in. A hot new prefix's followers then load it on idle instances where they
computed it cold. The router passes landings only with ``cost.wait_for_landing`` (off by
default: the capacity sweeps measured no consistent gain, docs/router.md).
A prompt that would break the TTFT SLO even on an idle instance is
served best effort and flagged ``over_slo`` (a 429 would tell the client to retry in
vain, and refusing it would keep its prefix out of every cache).

Pure functions of their inputs (no I/O, no clock), so the benchmark and tests call them
directly.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from kvcentric.router.config import BALANCE_REL, STALL_WEIGHT, TIE_TOLERANCE, WORK_WEIGHT, SloConfig
from kvcentric.router.cost.cost_model import Profile, tiered_load_s
from kvcentric.router.fleet.instances import Instance

T = TypeVar("T")


@dataclass(frozen=True)
class CostParams:
    """``bandwidth_bps``: the store's (DRAM tier's) read bandwidth; ``disk_bandwidth_bps``:
    its disk tier's (``None``: the same, i.e. no slower tier is modelled). Bytes/s.
    ``tie_tolerance``: predicted TTFTs within this fraction of the lowest are ties, broken
    by load (:func:`choose`). ``balance_abs``, ``balance_rel``: the bound on a candidate's
    running sequences over the least loaded's (:func:`overloaded`); ``None``: no bound.
    ``stall_weight``: what a second of a colocated prefill costs each of this router's
    requests on its processor, in seconds of the request's TTFT (see the module
    docstring; 0: none). ``work_weight``: what a second of the request's own prefill work
    (load and compute) on its prefill instance costs on top of its TTFT (0: none)."""

    profile: Profile
    block_size: int
    bytes_per_block: int
    bandwidth_bps: float
    disk_bandwidth_bps: float | None = None
    tie_tolerance: float = TIE_TOLERANCE
    balance_abs: int | None = None
    balance_rel: float = BALANCE_REL
    stall_weight: float = STALL_WEIGHT
    work_weight: float = WORK_WEIGHT

    def load_time_s(self, objects: int, on_disk: int = 0) -> float:
        """Time to load ``objects`` store objects (none when ``<= 0``), ``on_disk`` of
        them (clamped to ``[0, objects]``) from the disk tier."""
        objects = max(objects, 0)
        on_disk = min(max(on_disk, 0), objects)
        return tiered_load_s((objects - on_disk) * self.bytes_per_block,
                             on_disk * self.bytes_per_block, self.bandwidth_bps,
                             self.disk_bandwidth_bps or self.bandwidth_bps)


def on_disk_in(disk_only: Sequence[int], start: int, stop: int) -> int:
    """How many of the ascending positions ``disk_only`` lie in ``[start, stop)``."""
    if stop <= start or not disk_only:
        return 0
    return bisect.bisect_left(disk_only, stop) - bisect.bisect_left(disk_only, start)


@dataclass(frozen=True)
class Landing:
    """Blocks on their way into the store (:mod:`kvcentric.router.fleet.landings`): the
    prompt's leading ``run`` blocks are in the store or computed by the in-flight
    prefills of requests ``keys``, the last of which is predicted to end at ``ready_at``
    (the router's clock)."""

    run: int
    ready_at: float
    keys: tuple[str, ...]


@dataclass(frozen=True)
class PrefillCost:
    name: str
    local_blocks: int
    queue_s: float
    load_s: float
    prefill_s: float
    load_on_disk: int = 0  # objects of the load that come from the store's disk tier
    waits: bool = False  # starts once the landing is in the store, then loads it

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.load_s + self.prefill_s

    @property
    def work_s(self) -> float:
        """What the request would keep this instance busy for (its load, then its
        compute), as :attr:`Decision.work_s` once chosen."""
        return self.load_s + self.prefill_s


@dataclass(frozen=True)
class DecodeCost:
    name: str
    local_blocks: int
    load_s: float
    tbt_s: float


@dataclass(frozen=True)
class Decision:
    prefill: Instance
    decode: Instance
    ttft_s: float
    tbt_s: float
    prefill_s: float  # predicted compute time on p (its T_queue contribution)
    hit_tokens: int
    local_blocks: int
    load_blocks: int
    replicated: bool  # p loads from the store a prefix another instance holds (hot spot)
    candidates: tuple[PrefillCost, ...]
    over_slo: bool = False  # predicted to miss the TTFT SLO even with no queue: best effort
    load_on_disk: int = 0  # objects p loads from the store's disk tier (tail included)
    load_s: float = 0.0  # predicted store load on p before its prefill
    awaits: Landing | None = None  # sent once this landing is in the store (then loaded)

    @property
    def work_s(self) -> float:
        """What the request keeps ``p`` busy for (its load, then its compute): what
        queues there ahead of later requests."""
        return self.load_s + self.prefill_s

    @property
    def computed_from(self) -> int:
        """The prompt's first block ``prefill`` computes (before it: its own blocks and
        what it loads from the store, a landing included)."""
        return self.local_blocks + self.load_blocks

    @property
    def own_cost(self) -> PrefillCost | None:
        """``prefill``'s entry in ``candidates`` (None where a policy listed it not)."""
        return next((c for c in self.candidates if c.name == self.prefill.name), None)

    def booked_s(self, now: float) -> float:
        """What dispatching this at ``now`` queues on ``prefill``: its work, plus for a
        held request (``awaits``) the wait before it can start, during which the
        instance has nothing of it to run but must not be promised to others."""
        own = self.own_cost
        if self.awaits is None or own is None:
            return self.work_s
        return max(0.0, own.queue_s - self.prefill.queue_s(now)) + self.work_s

    def prefill_ends(self, now: float) -> float:
        """When the prefill dispatched at ``now`` is predicted to end (its blocks then
        stored): the prefill side's TTFT, the pair's where the candidate is not listed."""
        own = self.own_cost
        return now + (own.ttft_s if own is not None else self.ttft_s)

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not self.decode


@dataclass(frozen=True)
class Rejection:
    reason: str  # "ttft", "tbt" or "no_instance"
    retry_after_s: int
    ttft_s: float
    tbt_s: float
    message: str


def overloaded(running: int, least: int, params: CostParams) -> bool:
    """Whether an instance running ``running`` sequences is out of the candidates while
    one runs only ``least``: more than ``balance_abs`` beyond it and more than
    ``balance_rel`` times it (both, so a few sequences of difference on small batches, or
    a few percent on large ones, change nothing)."""
    ab = params.balance_abs
    return ab is not None and running - least > ab and running > params.balance_rel * least


def within_bound(candidates: list[T], instance: Callable[[T], Instance],
                 params: CostParams) -> list[T]:
    """``candidates`` less those whose instance is :func:`overloaded` next to the least
    loaded one's (all of them without a bound, or with one candidate)."""
    if params.balance_abs is None or len(candidates) < 2:
        return candidates
    loads = [instance(c).batch() for c in candidates]
    least = min(loads)
    return [c for c, n in zip(candidates, loads) if not overloaded(n, least, params)]


def hit_tokens(local: int, global_run: int, global_tail: bool, n_tokens: int,
               block_size: int) -> int:
    """Prompt tokens an engine holding ``local`` blocks finds cached or in the store (a
    stored tail after all blocks makes it ``n_tokens - 1``: the engine computes one)."""
    stored = n_tokens - 1 if global_tail else global_run * block_size
    return min(max(local * block_size, stored), n_tokens - 1)


# what a candidate's cost takes from its leading run alone: (objects on disk, load
# seconds, prefill seconds before the instance's correction)
_RunParts = tuple[int, float, float]


def prefill_cost(p: Instance, local: int, global_run: int, n_tokens: int,
                 params: CostParams, now: float, global_tail: bool = False,
                 disk_only: Sequence[int] = (), landing: Landing | None = None,
                 ttft_slo_s: float = math.inf,
                 memo: dict[tuple[int, bool], _RunParts] | None = None) -> PrefillCost:
    """Algorithm 1's ``TTFT_p`` for one candidate: load what the store holds beyond ``p``'s
    own blocks (a tail is one more object, at position ``global_run``; those at positions
    in ``disk_only`` from the disk tier), compute the rest. With a ``landing`` that
    extends what ``p`` would find, the better of that and waiting for the landing (no
    sooner than ``landing.ready_at``), then loading it too (``waits``): by the score's
    TTFT and work terms (:func:`choose`), unless waiting breaks ``ttft_slo_s`` where
    computing now would not. ``memo``: one dict shared by the candidates of one request
    (every other argument but ``p`` and ``local`` the same), so candidates with the same
    leading run share its load and compute times (a fleet's candidates mostly hold
    nothing of a prompt, or the same shared prefix)."""
    parts = memo.get((local, False)) if memo is not None else None
    if parts is None:
        hit = hit_tokens(local, global_run, global_tail, n_tokens, params.block_size)
        stop = global_run + int(global_tail)
        on_disk = on_disk_in(disk_only, local, stop)
        parts = (on_disk, params.load_time_s(stop - local, on_disk),
                 params.profile.prefill_s(n_tokens, hit))
        if memo is not None:
            memo[(local, False)] = parts
    on_disk, t_load, t_pre = parts[0], parts[1], parts[2] * p.correction
    now_cost = PrefillCost(p.name, local, p.queue_s(now, t_pre), t_load, t_pre, on_disk)
    if landing is None or landing.run <= max(local, global_run):
        return now_cost
    parts = memo.get((local, True)) if memo is not None else None
    if parts is None:
        hit = hit_tokens(local, landing.run, False, n_tokens, params.block_size)
        on_disk = on_disk_in(disk_only, local, global_run)
        parts = (on_disk, params.load_time_s(landing.run - local, on_disk),
                 params.profile.prefill_s(n_tokens, hit))
        if memo is not None:
            memo[(local, True)] = parts
    on_disk, t_load, t_pre = parts[0], parts[1], parts[2] * p.correction
    queue = max(p.queue_s(now, t_pre), landing.ready_at - now)
    wait_cost = PrefillCost(p.name, local, queue, t_load, t_pre, on_disk, waits=True)
    # by the score's own terms (:func:`choose`): waiting costs the fleet no compute
    w = params.work_weight
    better = wait_cost.ttft_s + w * wait_cost.work_s < now_cost.ttft_s + w * now_cost.work_s
    in_slo = wait_cost.ttft_s <= ttft_slo_s or now_cost.ttft_s > ttft_slo_s
    return wait_cost if better and in_slo else now_cost


def decode_cost(d: Instance, local: int, full_blocks: int, n_tokens: int,
                params: CostParams, disk_only: Sequence[int] = ()) -> DecodeCost:
    """Time for ``d`` to load the prompt's KV and take its first step, and its TBT with
    this request added to its batch. The prefill instance stores every full block and the
    tail, so ``d`` loads all but the last token and computes that one. Objects at
    ``disk_only`` positions count at the disk tier's bandwidth: the residency now, an upper
    bound (the prefill's own reads may promote them to DRAM first)."""
    tail = n_tokens - full_blocks * params.block_size >= 2
    stop = full_blocks + int(tail)
    t_load = params.load_time_s(stop - local, on_disk_in(disk_only, local, stop))
    first_step = params.profile.prefill_s(n_tokens, n_tokens - 1)
    tbt = params.profile.tbt_s(d.batch() + 1, d.stats.kv_usage)
    return DecodeCost(d.name, local, t_load + first_step, tbt)


class DecoderPick(NamedTuple):
    """The decode instance a split (P/D) pair would use: ``extra_s`` its load and first
    step on top of the prefill's TTFT."""

    extra_s: float
    instance: Instance
    cost: DecodeCost


class Pairing(NamedTuple):
    """One candidate prefill instance with the decode instance it would pair with;
    ``score_s``: what the choice minimises (``ttft_s`` plus the stall of the decodes a
    colocated prefill joins)."""

    ttft_s: float
    tbt_s: float
    prefill: Instance
    decode: Instance
    cost: PrefillCost
    score_s: float


def stall_s(decoding: int, step_s: float, params: CostParams) -> float:
    """The wait a prefill taking ``step_s`` seconds of the engine's steps (its compute, and
    on a colocated instance its synchronous load) inflicts on the ``decoding`` sequences
    that decode on its processor meanwhile (:func:`decoding_beside`), weighted by
    ``params.stall_weight``."""
    return params.stall_weight * decoding * step_s


def decoding_beside(instances: Sequence[Instance]) -> dict[int, int]:
    """Per instance (by ``id``), the sequences that will be decoding on its processor
    while a prefill sent there now runs: this router's requests in flight there
    (``decodes``), those still prefilling included (they are ahead in its queue, so they
    decode through the new prefill's steps; counting only those past their first token
    left a long prefill free to land behind a short one, whose whole decode it then
    stalled). On a shared processor, every listed instance's there. This router's own
    count, exact where the engine's running gauge is up to a poll old; other replicas'
    requests are not in it."""
    out: dict[int, int] = {}
    shared: list[Instance] = []
    for i in instances:  # a colocated instance is listed as prefill and as decode
        if i.proc.shared:
            shared.append(i)
        else:
            out[id(i)] = i.decodes
    if shared:
        per_proc: dict[int, int] = {}
        for i in {id(i): i for i in shared}.values():
            per_proc[id(i.proc)] = per_proc.get(id(i.proc), 0) + i.decodes
        out.update((id(i), per_proc[id(i.proc)]) for i in shared)
    return out


def _best_decoder(decode: Sequence[Instance], runs: dict[int, int], n_tokens: int,
                  params: CostParams, tbt_slo: float, disk_only: Sequence[int] = (),
                  base_ttft_s: float = 0.0) -> DecoderPick | None:
    """The decode-role instance with the soonest first token within the TBT SLO; those
    whose first token comes within ``tie_tolerance`` of the pair's TTFT (``base_ttft_s``,
    the prefill side's, plus the soonest decoder's part) are ties, taken by fewer of this
    router's decodes, then fewer running sequences. Without the ties the decoder already
    holding the prompt's prefix always won by its shorter load, so the first decoders to
    get a hot prefix took all of its requests and the others none (emulated P/D fleet,
    4 decoders: 31, 20, 13 and 0 requests).

    A decoder running far more sequences than the least loaded one (:func:`overloaded`,
    the bound prefills have) is no candidate. Where a long shared prefix makes the holder's
    load shorter by more than the tolerance (a coding agent's 20k-token system prompt and
    its sessions' growing contexts), the ties alone let the first decoder to hold it take
    every session, and its decodes stalled behind each request's load."""
    full_blocks = n_tokens // params.block_size
    picks: list[DecoderPick] = []
    for d in decode:
        if d.spec.role != "decode":
            continue  # a 'both' instance decodes only what it prefilled itself
        dc = decode_cost(d, runs.get(d.slot, 0), full_blocks, n_tokens, params, disk_only)
        if dc.tbt_s <= tbt_slo:
            picks.append(DecoderPick(dc.load_s + dc.tbt_s, d, dc))
    picks = within_bound(picks, lambda p: p.instance, params)
    if not picks:
        return None
    soonest = min(p.extra_s for p in picks)
    limit = soonest + params.tie_tolerance * (base_ttft_s + soonest)
    return min((p for p in picks if p.extra_s <= limit),
               key=lambda p: (p.instance.decodes, p.instance.batch(), p.extra_s))


def _rank(affinity: bytes, name: str) -> bytes:
    """Rendezvous rank of instance ``name`` for ``affinity`` (lowest first): the same in
    every router process (Python's ``hash`` is salted per process)."""
    return hashlib.blake2b(affinity + name.encode(), digest_size=8).digest()


def choose(prefill: Sequence[Instance], decode: Sequence[Instance], runs: dict[int, int],
           global_run: int, n_tokens: int, params: CostParams, slo: SloConfig,
           now: float, global_tail: bool = False, disk_only: Sequence[int] = (),
           affinity: bytes = b"", landing: Landing | None = None) -> Decision | Rejection:
    """Algorithm 1 over the healthy candidates; ``runs`` maps slot -> local leading run;
    ``global_tail``: the store holds the prompt's tail after its ``global_run`` blocks;
    ``disk_only``: ascending positions of the stored run (blocks, then the tail) that the
    store holds only on its disk tier; ``affinity``: breaks ties on separate processors by
    rendezvous rank (see the module docstring); ``landing``: blocks after the stored run
    that in-flight prefills will store (a candidate may wait for them: the decision's
    ``awaits``)."""
    if not prefill:
        return Rejection("no_instance", 1, math.inf, math.inf,
                         "no healthy instance that can prefill")
    tbt_slo = slo.tbt_ms / 1000.0
    memo: dict[tuple[int, bool], _RunParts] = {}
    costs = [prefill_cost(p, runs.get(p.slot, 0), global_run, n_tokens, params, now,
                          global_tail, disk_only, landing, slo.ttft_ms / 1000.0, memo)
             for p in prefill]
    # a pair is of one kind: an SGLang prefill hands its KV only to an SGLang decode (its
    # bootstrap protocol), a vLLM prefill to a vLLM decode (through the store)
    best_by_kind: dict[str, DecoderPick | None] = {}
    for kind in {p.spec.kind for p in prefill if p.spec.role != "both"}:
        split = [pc.ttft_s for p, pc in zip(prefill, costs)
                 if p.spec.role != "both" and p.spec.kind == kind]
        best_by_kind[kind] = _best_decoder([d for d in decode if d.spec.kind == kind], runs,
                                           n_tokens, params, tbt_slo, disk_only, min(split))
    pairs: list[Pairing] = []  # within the TBT SLO
    min_tbt = math.inf
    beside = decoding_beside([*prefill, *decode]) if params.stall_weight else {}
    for p, pc in zip(prefill, costs):
        if p.spec.role == "both":
            tbt = params.profile.tbt_s(p.batch() + 1, p.stats.kv_usage)
            # a colocated instance loads inside the step (the connector's default there):
            # its decodes wait for the load as for the compute
            pair = Pairing(pc.ttft_s, tbt, p, p, pc,
                           pc.ttft_s + stall_s(beside.get(id(p), 0), pc.work_s, params)
                           + params.work_weight * pc.work_s)
        elif (best_d := best_by_kind.get(p.spec.kind)) is not None:
            ttft = pc.ttft_s + best_d.extra_s
            pair = Pairing(ttft, best_d.cost.tbt_s, p, best_d.instance, pc,
                           ttft + params.work_weight * pc.work_s)
        else:
            continue
        min_tbt = min(min_tbt, pair.tbt_s)
        if pair.tbt_s <= tbt_slo:
            pairs.append(pair)
    pairs = within_bound(pairs, lambda pair: pair.prefill, params)
    slo_s = slo.ttft_ms / 1000.0
    # the score decides among pairs within the TTFT SLO; when none is, the lowest TTFT
    within = [pair for pair in pairs if pair.ttft_s <= slo_s]
    if within:
        pairs = within
    values = [pair.score_s if within else pair.ttft_s for pair in pairs]
    lowest = min(values, default=math.inf)
    # ties: within the tolerance of the lowest
    tied = [pair for pair, v in zip(pairs, values) if v <= lowest * (1.0 + params.tie_tolerance)]
    # a prefix resident on none of the tied: the affinity's rendezvous rank (replicas
    # agree) on separate processors; else the least queued prefill work, then on
    # separate processors the one running fewer of this router's requests (their decodes
    # would share the prefill's steps; its own count is exact where the engine's gauge
    # is up to a poll old), then fewer sequences by the gauge, then the emptier cache, so
    # new prefixes spread out; on a shared processor the busier one (one engine batching
    # beats two time-slicing it)
    ranked = bool(affinity) and not any(pair.cost.local_blocks for pair in tied)
    best: Pairing | None = None
    best_key: tuple[bytes, float, int, int, float, float] | None = None
    for pair in tied:
        p = pair.prefill
        rank = _rank(affinity, p.name) if ranked and not p.proc.shared else b""
        key = (rank, pair.cost.queue_s, -p.batch() if p.proc.shared else p.decodes,
               0 if p.proc.shared else p.batch(), p.stats.kv_usage, pair.ttft_s)
        if best_key is None or key < best_key:
            best, best_key = pair, key
    if best is None:
        msg = (f"predicted TBT {min_tbt * 1000:.0f} ms exceeds the SLO {slo.tbt_ms:.0f} ms"
               if math.isfinite(min_tbt) else
               "no decode instance can take the request within the TBT SLO")
        return Rejection("tbt", 1, math.inf, min_tbt, msg)
    ttft, tbt, p, d, pc = best.ttft_s, best.tbt_s, best.prefill, best.decode, best.cost
    # Refuse what load makes late. A prompt too long for the SLO even on an idle instance is
    # served best effort: refusing would not help it (no retry ever would) and serving it
    # caches its prefix for the requests that follow.
    if slo.reject and ttft > slo_s and ttft - pc.queue_s <= slo_s:
        excess = ttft - slo_s
        return Rejection("ttft", max(1, math.ceil(excess)), ttft, tbt,
                         f"predicted TTFT {ttft * 1000:.0f} ms exceeds the SLO "
                         f"{slo.ttft_ms:.0f} ms")
    awaits = landing if pc.waits else None
    if awaits is not None:  # what p finds once the landing is in: its run, no tail
        global_run, global_tail = awaits.run, False
    hit = hit_tokens(pc.local_blocks, global_run, global_tail, n_tokens, params.block_size)
    replicated = pc.local_blocks < global_run and any(
        runs.get(o.slot, 0) > pc.local_blocks for o in prefill if o is not p)
    return Decision(p, d, ttft, tbt, pc.prefill_s, hit,
                    pc.local_blocks, max(0, global_run - pc.local_blocks), replicated,
                    tuple(costs), over_slo=ttft > slo_s, load_on_disk=pc.load_on_disk,
                    load_s=pc.load_s, awaits=awaits)
