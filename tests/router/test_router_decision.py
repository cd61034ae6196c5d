"""Algorithm 1 (router.cost.decision.choose) on hand-built instance states."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kvcentric.router.config import RouterConfig, SloConfig
from kvcentric.router.cost.cost_model import Profile, load_s
from kvcentric.router.cost.decision import (
    CostParams,
    Decision,
    Landing,
    Rejection,
    choose,
    decode_cost,
    decoding_beside,
    prefill_cost,
)
from kvcentric.router.fleet.instance_spec import InstanceSpec
from kvcentric.router.fleet.instances import Instance, Registry
from kvcentric.router.fleet.prefix_index import PrefixIndex

BS = 256
PROFILE = Profile(a=1e-9, b=1e-4, c=0.005, tbt_base_s=0.02, tbt_per_seq_s=0.002)
# 4 KiB per token -> 1 MiB per block; 1 GB/s: a block loads in ~1 ms, computes in ~26 ms
PARAMS = CostParams(PROFILE, BS, 4096 * BS, 1e9)
SLO = SloConfig(ttft_ms=2000, tbt_ms=100)
N = 32 * BS + 10


def inst(name: str, slot: int, role: str = "both") -> Instance:
    return Instance(InstanceSpec(url=f"http://{name}:1", role=role, name=name), slot)


def test_prefers_the_instance_holding_the_prefix() -> None:
    a, b = inst("a", 0), inst("b", 1)
    d = choose([a, b], [a, b], {0: 0, 1: 30}, 0, N, PARAMS, SLO, now=0.0)
    assert isinstance(d, Decision) and d.prefill is b and d.decode is b
    assert not d.disaggregated and d.local_blocks == 30 and d.load_blocks == 0
    assert d.hit_tokens == 30 * BS
    costs = {c.name: c for c in d.candidates}
    assert costs["b"].ttft_s < costs["a"].ttft_s


def test_global_store_makes_every_instance_a_near_hit() -> None:
    a, b = inst("a", 0), inst("b", 1)
    d = choose([a, b], [a, b], {0: 0, 1: 30}, 30, N, PARAMS, SLO, now=0.0)
    assert isinstance(d, Decision)
    costs = {c.name: c for c in d.candidates}
    # a loads 30 blocks (30 MiB at 1 GB/s) instead of recomputing 30 blocks
    assert costs["a"].load_s == pytest.approx(30 * 4096 * BS / 1e9)
    assert costs["a"].prefill_s == pytest.approx(costs["b"].prefill_s)
    assert costs["a"].ttft_s < PROFILE.prefill_s(N, 0)


def test_hot_spot_goes_elsewhere_and_replicates_from_the_store() -> None:
    a, b = inst("a", 0), inst("b", 1)
    for i in range(20):  # b holds the hot prefix but has 20 prefills queued
        b.enqueue(f"r{i}", 0.1, now=0.0)
    d = choose([a, b], [a, b], {0: 0, 1: 30}, 30, N, PARAMS, SLO, now=0.0)
    assert isinstance(d, Decision) and d.prefill is a
    assert d.replicated and d.load_blocks == 30
    # without the store, a would recompute everything: then b's queue is still cheaper?
    d2 = choose([a, b], [a, b], {0: 0, 1: 30}, 0, N, PARAMS, SLO, now=0.0)
    assert isinstance(d2, Decision) and d2.prefill is a and not d2.replicated
    assert d2.ttft_s > d.ttft_s


def test_queue_drains_with_time() -> None:
    b = inst("b", 0)
    b.enqueue("x", 1.0, now=10.0)
    b.enqueue("y", 1.0, now=10.5)
    assert b.queue_s(10.5) == pytest.approx(1.5)
    b.prefill_done("x", now=11.0)
    assert b.queue_s(11.0) == pytest.approx(1.0)
    assert b.queue_s(13.5) == 0.0  # y never reported: assumed done after 2x its prediction
    assert b.queued == 0


def test_ttft_slo_rejects_with_retry_after() -> None:
    a = inst("a", 0)
    for i in range(40):
        a.enqueue(f"r{i}", 0.1, now=0.0)  # 4 s of queued prefill
    r = choose([a], [a], {}, 0, N, PARAMS, SLO, now=0.0)
    assert isinstance(r, Rejection) and r.reason == "ttft"
    assert r.retry_after_s == math.ceil(r.ttft_s - 2.0) >= 2
    assert "exceeds the SLO" in r.message


def test_a_prompt_too_long_for_the_slo_when_idle_is_served_best_effort() -> None:
    a = inst("a", 0)
    n = 20000 * 5  # ~10 s of prefill on an idle instance
    d = choose([a], [a], {}, 0, n, PARAMS, SLO, now=0.0)
    assert isinstance(d, Decision) and d.over_slo and d.ttft_s > 2.0
    a.enqueue("x", 1.0, now=0.0)  # with a queue the excess is still not the queue's fault
    d = choose([a], [a], {}, 0, n, PARAMS, SLO, now=0.0)
    assert isinstance(d, Decision) and d.over_slo


def test_reject_off_serves_late_requests_best_effort() -> None:
    a = inst("a", 0)
    for i in range(40):
        a.enqueue(f"r{i}", 0.1, now=0.0)
    lenient = SloConfig(ttft_ms=2000, tbt_ms=100, reject=False)
    d = choose([a], [a], {}, 0, N, PARAMS, lenient, now=0.0)
    assert isinstance(d, Decision) and d.over_slo and d.ttft_s > 4.0
    with pytest.raises(ValueError, match="slo.reject"):
        SloConfig(reject="no")  # type: ignore[arg-type]


def test_instances_on_one_compute_share_it_fairly() -> None:
    reg = Registry(PrefixIndex(), 64, sharing="fair")
    a, b, c = (reg.add(InstanceSpec(url=f"http://{n}:1", name=n, compute=g))
               for n, g in (("a", "gpu0"), ("b", "gpu0"), ("c", None)))
    a.enqueue("x", 1.0, now=0.0)
    # b does not wait behind a's prefill, but shares the processor with it while both run
    assert b.queue_s(0.5) == 0.0 and (a.queued, b.queued) == (1, 0)
    assert b.queue_s(0.5, work_s=0.2) == pytest.approx(0.2)  # a takes as much meanwhile
    assert b.queue_s(0.5, work_s=2.0) == pytest.approx(0.5)  # ... until its 0.5 s are done
    assert a.queue_s(0.5, work_s=0.1) == pytest.approx(0.5)  # a's own queue is FIFO
    assert c.queue_s(0.5, work_s=1.0) == 0.0
    # b holds the prefix, but shares a processor busy for 1 s: c (idle) is cheaper
    d = choose([a, b, c], [a, b, c], {1: 4}, 0, N, PARAMS, SLO, now=0.0)
    assert isinstance(d, Decision) and d.prefill is c
    b.prefill_done("x", now=0.2)  # the processor drops the prefill whichever instance reports
    assert a.queue_s(0.2) == 0.0
    a.observe(1.0, 2.0)  # one processor, one speed
    assert a.correction == b.correction > 1.0 and c.correction == 1.0
    # same processor, same prefix knowledge: the instance running more sequences (one
    # engine batching), then the emptier cache; a prefix held locally still wins over both
    a.decodes = 2
    d = choose([a, b], [a, b], {}, 0, N, PARAMS, SLO, now=1.0)
    assert isinstance(d, Decision) and d.prefill is a
    a.decodes, a.stats.kv_usage = 0, 0.5
    d = choose([a, b], [a, b], {}, 0, N, PARAMS, SLO, now=1.0)
    assert isinstance(d, Decision) and d.prefill is b
    d = choose([a, b], [a, b], {1: 8}, 8, N, PARAMS, SLO, now=1.0)
    assert isinstance(d, Decision) and d.prefill is b and d.load_blocks == 0
    with pytest.raises(ValueError, match="compute"):
        InstanceSpec(url="http://d:1", compute="bad name")


def test_busy_instances_on_one_processor_progress_at_half_speed() -> None:
    reg = Registry(PrefixIndex(), 64, sharing="fair")
    a, b = (reg.add(InstanceSpec(url=f"http://{n}:1", name=n, compute="cpu")) for n in "ab")
    a.enqueue("x", 1.0, now=0.0)
    b.enqueue("y", 3.0, now=0.0)
    # both run at half speed: at t=1 each has done 0.5 s of work
    assert a.queue_s(1.0) == pytest.approx(0.5 + 0.5)
    # x ends at t=2 (1 s of work at half speed); y then runs alone: 2 s left at t=2
    assert b.queue_s(2.0) == pytest.approx(2.0) and a.queued == 0
    assert b.queue_s(4.0) == 0.0 and b.queued == 0  # predicted done, never reported
    reg.remove("b")
    a.enqueue("z", 1.0, now=4.0)
    assert a.queue_s(4.5) == pytest.approx(0.5)


def test_serial_processor_is_one_fifo_over_its_instances() -> None:
    """The default: instances on one compute run one prefill at a time, in dispatch order,
    whichever instance got it; a prefill on the idle one waits for the busy one's."""
    reg = Registry(PrefixIndex(), 64)
    a, b, c = (reg.add(InstanceSpec(url=f"http://{n}:1", name=n, compute=g))
               for n, g in (("a", "cpu"), ("b", "cpu"), ("c", None)))
    assert a.proc is b.proc and a.proc.shared and not c.proc.shared
    a.enqueue("x", 1.0, now=0.0)
    b.enqueue("y", 2.0, now=0.5)
    assert b.queue_s(0.5) == pytest.approx(0.5 + 2.0)  # x's rest, then y: one FIFO
    assert a.queue_s(0.5, work_s=5.0) == pytest.approx(2.5)  # own work never counts twice
    assert b.queue_s(1.5) == pytest.approx(1.5) and a.queued == 0  # x done at t=1
    # b holds the prefix on a busy processor: c (its own processor, idle) is cheaper
    d = choose([a, b, c], [a, b, c], {1: 4}, 0, N, PARAMS, SLO, now=1.5)
    assert isinstance(d, Decision) and d.prefill is c
    assert not a.proc.idle(2.0) and a.proc.idle(3.0)
    # on the idle shared processor a tie goes to the instance batching more
    b.decodes = 1
    d = choose([a, b], [a, b], {}, 0, N, PARAMS, SLO, now=5.0)
    assert isinstance(d, Decision) and d.prefill is b
    reg.remove("b")
    assert not a.proc.shared and a.proc.idle(5.0)
    with pytest.raises(ValueError, match="shared_compute"):
        RouterConfig.from_dict({"model": "m", "tokenizer": "x",
                                "cost": {"shared_compute": "round-robin"}})


def test_tbt_slo_steers_and_rejects() -> None:
    a, b = inst("a", 0), inst("b", 1)
    a.stats.running = 60  # 20 + 2*60 ms > 100 ms
    d = choose([a, b], [a, b], {0: 30}, 0, N, PARAMS, SLO, now=0.0)
    assert isinstance(d, Decision) and d.prefill is b  # a has the prefix but decodes too slowly
    b.stats.kv_usage = 0.99  # b would preempt
    r = choose([a, b], [a, b], {0: 30}, 0, N, PARAMS, SLO, now=0.0)
    assert isinstance(r, Rejection) and r.reason == "tbt"


def test_disaggregated_pair_counts_the_decode_side_load() -> None:
    p1, p2 = inst("p1", 0, "prefill"), inst("p2", 1, "prefill")
    d1, d2 = inst("d1", 2, "decode"), inst("d2", 3, "decode")
    d1.decodes = 30  # d1 slower per token
    res = choose([p1, p2], [d1, d2], {1: 32, 3: 32}, 32, N, PARAMS, SLO, now=0.0)
    assert isinstance(res, Decision) and res.disaggregated
    assert res.prefill is p2 and res.decode is d2
    own = {c.name: c for c in res.candidates}["p2"]
    # d2 holds the prompt's blocks already: it loads the tail object p2 stored, computes
    # the last token, plus one decode step
    tail_load = load_s(PARAMS.bytes_per_block, PARAMS.bandwidth_bps)
    first_step = PROFILE.prefill_s(N, N - 1)
    assert res.ttft_s == pytest.approx(own.ttft_s + tail_load + first_step + PROFILE.tbt_s(1))
    assert res.hit_tokens == 32 * BS  # p2's own blocks; p2 computes the tail


def decode_in_turn(n: int, p: Instance, ds: list[Instance], runs: dict[int, int],
                   params: CostParams, slo: SloConfig) -> list[str]:
    """The decoders ``n`` requests of one prompt go to, one after another, each counted
    as decoding there before the next is placed."""
    taken = []
    for _ in range(n):
        res = choose([p], ds, runs, 32, N, params, slo, now=0.0)
        assert isinstance(res, Decision) and res.disaggregated
        res.decode.decodes += 1
        taken.append(res.decode.name)
    return taken


def test_decoders_whose_first_token_is_as_soon_share_the_requests() -> None:
    """A decoder holding the prompt loads less, but within the tie tolerance of the pair's
    TTFT the least busy decoder takes it: a hot prefix's requests spread over every
    decoder instead of piling on the first ones that held it."""
    p = inst("p", 0, "prefill")
    ds = [inst(f"d{i}", 1 + i, "decode") for i in range(4)]
    runs = {1: 32, 2: 32}  # d0 and d1 hold the prompt's blocks, d2 and d3 nothing
    p.enqueue("queued", 1.0, now=0.0)  # TTFT ~1 s: loading the prompt (33 ms) is a tie
    taken = decode_in_turn(8, p, ds, runs, PARAMS, SLO)
    assert sorted(taken) == ["d0", "d0", "d1", "d1", "d2", "d2", "d3", "d3"]
    assert taken[:2] == ["d0", "d1"]  # equally idle: the shorter load first
    # with nothing queued the 33 ms load is no tie: the holder keeps it, busier or not
    p.prefill_done("queued", now=0.0)
    for d in ds:
        d.decodes = 0
    ds[0].decodes = 3
    res = choose([p], ds, {1: 32}, 32, N, PARAMS, SLO, now=0.0)
    assert isinstance(res, Decision) and res.decode is ds[0]


def test_a_stored_tail_is_a_hit_of_all_but_the_last_token() -> None:
    a, b = inst("a", 0), inst("b", 1)
    with_tail = choose([a, b], [a, b], {}, 32, N, PARAMS, SLO, now=0.0, global_tail=True)
    without = choose([a, b], [a, b], {}, 32, N, PARAMS, SLO, now=0.0)
    assert isinstance(with_tail, Decision) and isinstance(without, Decision)
    assert with_tail.hit_tokens == N - 1 and without.hit_tokens == 32 * BS
    # one more object loaded, the tail's 9 tokens no longer prefilled
    pa = {c.name: c for c in with_tail.candidates}["a"]
    assert pa.load_s == pytest.approx(load_s(33 * PARAMS.bytes_per_block, PARAMS.bandwidth_bps))
    assert pa.prefill_s == pytest.approx(PROFILE.prefill_s(N, N - 1))
    assert with_tail.ttft_s == pytest.approx(pa.load_s + pa.prefill_s)


# the same store, its disk tier 4x slower than its DRAM
TIERED = CostParams(PROFILE, BS, 4096 * BS, 1e9, 2.5e8)


def test_a_prefix_on_disk_is_predicted_slower_by_the_bandwidth_difference() -> None:
    a = inst("a", 0)
    in_dram = prefill_cost(a, 0, 32, N, TIERED, 0.0, True)
    on_disk = prefill_cost(a, 0, 32, N, TIERED, 0.0, True, tuple(range(10, 33)))
    obj = TIERED.bytes_per_block
    assert in_dram.load_s == pytest.approx(33 * obj / 1e9) and in_dram.load_on_disk == 0
    assert on_disk.load_on_disk == 23  # blocks 10..31 and the tail
    assert on_disk.ttft_s - in_dram.ttft_s == pytest.approx(23 * obj * (1 / 2.5e8 - 1 / 1e9))
    assert (on_disk.queue_s, on_disk.prefill_s) == (in_dram.queue_s, in_dram.prefill_s)
    # only what the instance loads counts: blocks it holds itself are not read from disk
    mine = prefill_cost(a, 20, 32, N, TIERED, 0.0, True, tuple(range(10, 20)))
    assert mine.load_on_disk == 0 and mine.load_s == pytest.approx(13 * obj / 1e9)
    # without a disk bandwidth (PARAMS) the tier is not modelled: DRAM speed
    flat = prefill_cost(a, 0, 32, N, PARAMS, 0.0, True, tuple(range(10, 33)))
    assert flat.load_s == pytest.approx(in_dram.load_s)
    d = inst("d", 1, "decode")
    dram_d = decode_cost(d, 0, 32, N, TIERED)
    disk_d = decode_cost(d, 0, 32, N, TIERED, tuple(range(33)))
    assert disk_d.load_s - dram_d.load_s == pytest.approx(33 * obj * (1 / 2.5e8 - 1 / 1e9))


def test_the_decision_prefers_dram_residency_where_it_matters() -> None:
    """After a store restart every stored block is on disk only: an idle instance that
    must load the whole prefix is then slower than a slightly busy one holding most of it,
    which it is not when the prefix is in DRAM."""
    a, b = inst("a", 0), inst("b", 1)
    a.enqueue("x", 0.05, now=0.0)  # a holds 24 of the 32 blocks but has 50 ms queued
    runs = {0: 24}
    dram = choose([a, b], [a, b], runs, 32, N, TIERED, SLO, now=0.0)
    disk = choose([a, b], [a, b], runs, 32, N, TIERED, SLO, now=0.0,
                  disk_only=tuple(range(32)))
    assert isinstance(dram, Decision) and isinstance(disk, Decision)
    assert dram.prefill is b and dram.load_blocks == 32 and dram.load_on_disk == 0
    assert disk.prefill is a and disk.load_blocks == 8 and disk.load_on_disk == 8
    # the tier only moved the load times: b's by 32 objects, a's by its 8
    cost = {c.name: c for c in disk.candidates}
    obj, extra = TIERED.bytes_per_block, 1 / 2.5e8 - 1 / 1e9
    base = {c.name: c for c in dram.candidates}
    assert cost["b"].ttft_s - base["b"].ttft_s == pytest.approx(32 * obj * extra)
    assert cost["a"].ttft_s - base["a"].ttft_s == pytest.approx(8 * obj * extra)


def test_no_instances_and_no_decoder() -> None:
    r = choose([], [], {}, 0, N, PARAMS, SLO, now=0.0)
    assert isinstance(r, Rejection) and r.reason == "no_instance"
    p = inst("p", 0, "prefill")
    r = choose([p], [], {}, 0, N, PARAMS, SLO, now=0.0)
    assert isinstance(r, Rejection) and r.reason == "tbt"


def test_correction_factor_is_bounded() -> None:
    a = inst("a", 0)
    for _ in range(50):
        a.observe(0.1, 10.0)
    c = a.correction
    assert c == pytest.approx(4.0, rel=1e-3) and c <= 4.0
    a.observe(0.0, 1.0)  # ignored
    assert a.correction == c


def test_one_mispredicted_hit_does_not_mark_an_instance_slow() -> None:
    """A prefill the model thought 24 blocks cached that the engine computed whole (its
    residency was stale: 4.9 s for a predicted 0.08 s) is not a slow processor: the
    correction stays; a second such prefill in a row is a change of speed, and learned.
    (In the 8-engine hot-prefix fleet, learning the lone one kept 4 of 8 instances idle.)"""
    a = inst("a", 0)
    a.observe(0.079, 4.9)
    assert a.correction == 1.0
    a.observe(1.0, 1.05)  # back to normal: still nothing but noise learned
    a.observe(0.079, 4.9)
    assert a.correction == pytest.approx(1.01)
    a.observe(0.5, 2.0)  # two in a row, the same way: the processor is slower now
    assert a.correction > 1.5
    b = inst("b", 1)
    b.observe(1.0, 0.2)  # a lone one far faster (a hit the model did not know of)
    assert b.correction == 1.0


def _stored_prefix_pair() -> tuple[Instance, Instance, dict[int, int]]:
    """Two idle instances on their own processors, the prompt's first 30 blocks in the
    store and on neither: ``a``'s measured correction is 2% below ``b``'s."""
    a, b = inst("a", 0), inst("b", 1)
    a.observe(1.0, 0.9)  # one observation: a's prefills ran 10% faster than predicted
    assert a.correction == pytest.approx(0.98) and b.correction == 1.0
    return a, b, {}


def test_predictions_within_the_tolerance_are_a_tie_that_goes_to_the_idle_instance() -> None:
    """A correction a few percent lower must not pull requests onto an instance that
    already has work queued while an idle one predicts within the model's noise."""
    a, b, runs = _stored_prefix_pair()
    a.enqueue("r0", 0.0005, now=0.0)  # 0.5 ms queued: a still predicts the lowest TTFT
    costs = {c.name: c for c in choose([a, b], [a, b], runs, 30, N, PARAMS, SLO, 0.0)
             .candidates}  # type: ignore[union-attr]
    assert costs["a"].ttft_s < costs["b"].ttft_s < costs["a"].ttft_s * 1.05
    d = choose([a, b], [a, b], runs, 30, N, PARAMS, SLO, now=0.0)
    assert isinstance(d, Decision) and d.prefill is b
    exact = CostParams(PROFILE, BS, 4096 * BS, 1e9, tie_tolerance=0.0)  # the lowest wins
    d = choose([a, b], [a, b], runs, 30, N, exact, SLO, now=0.0)
    assert isinstance(d, Decision) and d.prefill is a
    # with equal queues the tie goes to the instance running fewer sequences
    a.prefill_done("r0", now=0.0)
    a.decodes, b.decodes = 0, 3
    d = choose([a, b], [a, b], runs, 30, N, PARAMS, SLO, now=0.0)
    assert isinstance(d, Decision) and d.prefill is a


def test_a_difference_beyond_the_tolerance_still_decides() -> None:
    """Ties are only ties: a cheaper instance by more than the tolerance (here the one
    holding the prefix with nothing in the store) wins however loaded it is."""
    a, b = inst("a", 0), inst("b", 1)
    a.enqueue("r0", 0.05, now=0.0)
    a.decodes = 10
    d = choose([a, b], [a, b], {0: 30}, 0, N, PARAMS, SLO, now=0.0)
    assert isinstance(d, Decision) and d.prefill is a
    costs = {c.name: c.ttft_s for c in d.candidates}
    assert costs["b"] > costs["a"] * (1 + PARAMS.tie_tolerance)


def test_a_tie_never_breaks_an_slo_the_lowest_meets() -> None:
    a, b, runs = _stored_prefix_pair()
    a.enqueue("r0", 0.0005, now=0.0)
    costs = {c.name: c.ttft_s for c in choose([a, b], [a, b], runs, 30, N, PARAMS, SLO,
                                              0.0).candidates}  # type: ignore[union-attr]
    tight = SloConfig(ttft_ms=(costs["a"] + costs["b"]) / 2 * 1000, tbt_ms=100)
    d = choose([a, b], [a, b], runs, 30, N, PARAMS, tight, now=0.0)
    assert isinstance(d, Decision) and d.prefill is a and not d.over_slo
    with pytest.raises(ValueError, match="tie_tolerance"):
        RouterConfig.from_dict({"model": "m", "tokenizer": "x",
                                "cost": {"tie_tolerance": 1.5}})


def test_replicas_with_different_load_views_agree_where_a_new_prefix_goes() -> None:
    """Two routers see the same idle fleet but different batches (each reads the engines'
    gauges at its own moments): by batch they would pick different instances for a prefix
    resident nowhere and both compute it; the affinity's rendezvous rank makes them agree,
    and different prefixes still spread over the fleet."""
    names = [f"e{i}" for i in range(8)]
    view_a = [inst(n, i) for i, n in enumerate(names)]
    view_b = [inst(n, i) for i, n in enumerate(names)]
    for i, x in enumerate(view_a):
        x.stats.running = i  # router A read the last ones busiest
    for i, x in enumerate(view_b):
        x.stats.running = 7 - i  # router B the other way round
    picks = []
    for k in range(200):
        aff = k.to_bytes(4, "little") * 4
        da = choose(view_a, view_a, {}, 0, N, PARAMS, SLO, now=0.0, affinity=aff)
        db = choose(view_b, view_b, {}, 0, N, PARAMS, SLO, now=0.0, affinity=aff)
        assert isinstance(da, Decision) and isinstance(db, Decision)
        assert da.prefill.name == db.prefill.name
        picks.append(da.prefill.name)
    assert all(10 <= picks.count(n) <= 45 for n in names), {n: picks.count(n) for n in names}
    # without an affinity each takes its least-loaded instance: they disagree
    da = choose(view_a, view_a, {}, 0, N, PARAMS, SLO, now=0.0)
    db = choose(view_b, view_b, {}, 0, N, PARAMS, SLO, now=0.0)
    assert isinstance(da, Decision) and isinstance(db, Decision)
    assert (da.prefill.name, db.prefill.name) == ("e0", "e7")


def test_affinity_never_overrides_a_hit_or_a_queue_beyond_the_tolerance() -> None:
    a, b = inst("a", 0), inst("b", 1)
    for k in range(32):
        aff = bytes([k]) * 16
        d = choose([a, b], [a, b], {0: 0, 1: 30}, 0, N, PARAMS, SLO, now=0.0, affinity=aff)
        assert isinstance(d, Decision) and d.prefill is b  # the prefix holder, always
    b.enqueue("r", 1.0, 0.0)  # a second of queued prefill on b
    for k in range(32):
        aff = bytes([k]) * 16
        d = choose([a, b], [a, b], {}, 0, N, PARAMS, SLO, now=0.0, affinity=aff)
        assert isinstance(d, Decision) and d.prefill is a


def test_affinity_ranks_only_ties_where_no_instance_holds_the_prefix() -> None:
    """A hot prefix held by two engines: whichever the rank prefers, the one not decoding
    takes the next request (its prefill chunks would stall the other's decodes); the rank
    still places a prefix that neither holds, among instances whose batches differ by the
    gauge only. A prefix neither holds, beside decodes this router sent: the stall of
    those decodes outweighs the rank (see the next test)."""
    a, b = inst("a", 0), inst("b", 1)
    a.decodes = 6
    for k in range(32):
        aff = bytes([k]) * 16
        d = choose([a, b], [a, b], {0: 30, 1: 30}, 0, N, PARAMS, SLO, now=0.0, affinity=aff)
        assert isinstance(d, Decision) and d.prefill is b
    picks = {choose([a, b], [a, b], {}, 0, N, PARAMS, SLO, now=0.0,  # type: ignore[union-attr]
                    affinity=bytes([k]) * 16).prefill.name for k in range(32)}
    assert picks == {"b"}
    a.decodes, a.stats.running = 0, 6  # busy by the gauge alone
    picks = {choose([a, b], [a, b], {}, 0, N, PARAMS, SLO, now=0.0,  # type: ignore[union-attr]
                    affinity=bytes([k]) * 16).prefill.name for k in range(32)}
    assert picks == {"a", "b"}  # by rank, not by load


def test_a_colocated_prefill_goes_where_it_stalls_the_fewest_decodes() -> None:
    """A prefill on a ``both`` instance shares the engine's steps with the sequences
    decoding there: the choice weighs its compute once per such sequence. A long uncached
    prefill leaves an instance holding part of its prefix for an idle one when that
    instance decodes; a prompt mostly cached there (little compute) still goes there;
    ``stall_weight: 0`` is Algorithm 1 on TTFT alone."""
    a, b = inst("a", 0), inst("b", 1)
    for _ in range(3):  # three of this router's requests decoding on a
        a.decodes += 1
    runs = {0: 8}  # a holds 8 of the prompt's 32 blocks: ~0.2 s less compute there
    d = choose([a, b], [a, b], runs, 0, N, PARAMS, SLO, now=0.0)
    assert isinstance(d, Decision) and d.prefill is b
    costs = {c.name: c for c in d.candidates}
    assert costs["a"].ttft_s < costs["b"].ttft_s  # the lower TTFT lost to the stall
    blind = replace(PARAMS, stall_weight=0.0)
    d = choose([a, b], [a, b], runs, 0, N, blind, SLO, now=0.0)
    assert isinstance(d, Decision) and d.prefill is a
    d = choose([a, b], [a, b], {0: 31}, 0, N, PARAMS, SLO, now=0.0)  # one block to compute
    assert isinstance(d, Decision) and d.prefill is a
    # a short request still prefilling counts too: ahead in the queue, it decodes
    # through the whole of a long prefill sent after it
    c = inst("c", 2)
    c.decodes = 1
    c.enqueue("q", 0.01, 0.0)
    d = choose([b, c], [b, c], {2: 8}, 0, N, PARAMS, SLO, now=0.0)  # c holds a part
    assert isinstance(d, Decision) and d.prefill is b
    # decodes on a shared processor are stalled by a prefill on any of its instances
    reg = Registry(PrefixIndex(), 1024, "fair")
    f, g = (reg.add(InstanceSpec(url=f"http://{n}:1", name=n, compute="gpu0"))
            for n in ("f", "g"))
    f.decodes = 2
    assert decoding_beside([f, g]) == {id(f): 2, id(g): 2}
    with pytest.raises(ValueError, match="stall_weight"):
        RouterConfig.from_dict({"model": "m", "tokenizer": "x", "cost": {"stall_weight": -1}})


def test_a_tie_goes_to_the_instance_without_this_routers_requests_over_a_stale_gauge() -> None:
    """The engine's running gauge is read every few seconds: an instance that just
    finished still shows sequences, one that just took this router's request shows none.
    Among ties this router's own count decides first."""
    a, b = inst("a", 0), inst("b", 1)
    a.stats.running = 2  # a poll old: a is idle now
    b.decodes = 1  # decoding this router's request since the last poll
    for k in range(8):
        d = choose([a, b], [a, b], {0: 30, 1: 30}, 0, N, PARAMS, SLO, now=0.0,
                   affinity=bytes([k]) * 16)
        assert isinstance(d, Decision) and d.prefill is a



def test_a_pair_is_of_one_kind() -> None:
    """An SGLang prefill hands its KV only to an SGLang decode (its bootstrap protocol),
    a vLLM prefill only to a vLLM decode (the store): the best decoder of the other kind
    is never its partner, however much cheaper."""
    def kinded(name: str, slot: int, role: str, kind: str) -> Instance:
        return Instance(InstanceSpec(url=f"http://{name}:1", role=role, name=name,
                                     kind=kind), slot)

    vp, sp = kinded("vp", 0, "prefill", "vllm"), kinded("sp", 1, "prefill", "sglang")
    vd, sd = kinded("vd", 2, "decode", "vllm"), kinded("sd", 3, "decode", "sglang")
    for i in range(8):  # the vLLM decoder is busy, the SGLang one idle
        vd.decodes += 1
        vp.enqueue(f"q{i}", 0.5, now=0.0)  # and the vLLM prefill queued
    d = choose([vp, sp], [vd, sd], {}, 0, N, PARAMS, SLO, now=0.0)
    assert isinstance(d, Decision) and (d.prefill, d.decode) == (sp, sd)
    late_ok = SloConfig(ttft_ms=2000, tbt_ms=100, reject=False)  # its queue is long
    d = choose([vp], [vd, sd], {}, 0, N, PARAMS, late_ok, now=0.0)  # only a vLLM prefill
    assert isinstance(d, Decision) and (d.prefill, d.decode) == (vp, vd)
    d = choose([sp], [vd], {}, 0, N, PARAMS, SLO, now=0.0)  # no SGLang decoder: no pair
    assert isinstance(d, Rejection)


@pytest.mark.parametrize("raw, why", [
    ({"kind": "trtllm"}, "instance kind 'trtllm' must be one of"),
    ({"kind": "sglang", "role": "prefill", "bootstrap_port": 0}, "must be a port"),
    ({"kind": "sglang", "role": "prefill", "bootstrap_port": True}, "must be an integer"),
    ({"kind": "sglang", "role": "decode", "bootstrap_port": 8998}, "needs kind sglang and "
                                                                    "role prefill"),
    ({"role": "prefill", "bootstrap_port": 8998}, "needs kind sglang"),
])
def test_instance_kind_and_bootstrap_port_are_checked(raw: dict[str, object],
                                                      why: str) -> None:
    with pytest.raises(ValueError, match=why):
        InstanceSpec.from_dict({"url": "http://p:1", **raw})
    ok = InstanceSpec.from_dict({"url": "http://p:1", "kind": "sglang", "role": "prefill",
                                 "bootstrap_port": 8998})
    assert (ok.kind, ok.bootstrap_port) == ("sglang", 8998)
    assert InstanceSpec.from_dict({"url": "http://p:1"}).kind == "vllm"


# ---- the load bound: a hot prefix's holder stops taking everything ----

BALANCED = CostParams(PROFILE, BS, 4096 * BS, 1e9, balance_abs=4, balance_rel=1.5)
ROOMY = SloConfig(ttft_ms=2000, tbt_ms=1000)  # large batches stay within the TBT SLO


def running(i: Instance, n: int) -> Instance:
    i.decodes = n  # this router's requests in flight there
    return i


@pytest.mark.parametrize("holder, other, moved", [
    (10, 0, True),    # far beyond the idle one, in both senses: not a candidate
    (4, 0, False),    # only balance_abs more: still the holder's
    (60, 50, False),  # 10 more, but not 1.5x: large batches differ by a few percent
    (80, 50, True),   # 30 more and 1.6x
])
def test_a_holder_running_far_more_than_the_least_loaded_is_not_a_candidate(
        holder: int, other: int, moved: bool) -> None:
    a, b = running(inst("a", 0), other), running(inst("b", 1), holder)
    d = choose([a, b], [a, b], {0: 0, 1: 30}, 0, N, BALANCED, ROOMY, now=0.0)
    assert isinstance(d, Decision) and d.prefill is (a if moved else b)
    # without the bound (the default of CostParams) the holder always wins: greedy TTFT
    d = choose([a, b], [a, b], {0: 0, 1: 30}, 0, N, PARAMS, ROOMY, now=0.0)
    assert isinstance(d, Decision) and d.prefill is b


def test_the_bound_keeps_the_least_loaded_and_prefers_holders_among_the_rest() -> None:
    """Of three, the overloaded holder is out; the other holder (loaded, within the bound)
    still beats the idle instance that would recompute the prefix."""
    a, b, c = running(inst("a", 0), 0), running(inst("b", 1), 12), running(inst("c", 2), 3)
    d = choose([a, b, c], [a, b, c], {0: 0, 1: 30, 2: 30}, 0, N, BALANCED, ROOMY, now=0.0)
    assert isinstance(d, Decision) and d.prefill is c
    # every instance equally loaded: nothing is out, however high the load
    for i in (a, b, c):
        running(i, 40)
    d = choose([a, b, c], [a, b, c], {0: 0, 1: 30, 2: 30}, 0, N, BALANCED, ROOMY, now=0.0)
    assert isinstance(d, Decision) and d.prefill in (b, c)


@pytest.mark.parametrize("cost, msg", [
    ({"balance_abs": -1}, "balance_abs"), ({"balance_abs": 2.5}, "balance_abs"),
    ({"balance_abs": True}, "balance_abs"), ({"balance_rel": 0.5}, "balance_rel"),
    ({"balance_rel": "x"}, "balance_rel"),
])
def test_bad_balance_settings_are_refused(cost: dict[str, object], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        RouterConfig.from_dict({"model": "m", "tokenizer": "t", "cost": cost})


def test_the_router_config_bounds_by_default_and_null_turns_it_off() -> None:
    on = RouterConfig.from_dict({"model": "m", "tokenizer": "t"}).cost
    assert on.balance_abs is not None and on.balance_rel >= 1
    off = RouterConfig.from_dict({"model": "m", "tokenizer": "t",
                                  "cost": {"balance_abs": None}}).cost
    assert off.balance_abs is None


def test_a_decoder_running_far_more_than_the_least_loaded_is_not_a_candidate() -> None:
    """The bound holds for decoders too: a long shared prefix makes its holder's load
    shorter than any tie, so without the bound one decoder took every session (the
    emulated coding-agent workload: 372 of 372 requests on one of 4 decoders)."""
    p = inst("p", 0, "prefill")
    ds = [inst(f"d{i}", 1 + i, "decode") for i in range(2)]
    runs = {1: 32}  # d0 holds the prompt: d1 would load 33 objects more
    taken = decode_in_turn(12, p, ds, runs, BALANCED, ROOMY)
    # the holder until it runs balance_abs beyond the idle one, then both, within the bound
    assert taken[:5] == ["d0"] * 5 and taken[5] == "d1"
    assert ds[0].decodes - ds[1].decodes <= 5 and ds[1].decodes >= 3
    # without the bound (CostParams' default) the holder takes all of them
    for d in ds:
        d.decodes = 0
    assert decode_in_turn(12, p, ds, runs, PARAMS, ROOMY) == ["d0"] * 12


def test_a_colocated_load_stalls_the_decodes_beside_it_as_compute_does() -> None:
    """A prompt whose prefix is resident on ``a`` and in the store: ``b`` runs fewer of
    this router's decodes but must load the prefix, inside the step its decodes share.
    Weighing compute alone sent the request to ``b``; with the load the stall there is
    larger and it stays on ``a``. On a P/D prefill instance no decode waits on the load."""
    bw = 32 * 4096 * BS / 0.02  # the 32 stored blocks load in 20 ms
    params = replace(PARAMS, bandwidth_bps=bw, work_weight=0.0)  # the stall alone
    a, b = inst("a", 0), inst("b", 1)
    a.decodes, b.decodes = 6, 2  # within the balance bound
    d = choose([a, b], [a, b], {0: 32}, 32, N, params, SLO, now=0.0)
    assert isinstance(d, Decision) and d.prefill is a
    costs = {c.name: c for c in d.candidates}
    assert costs["b"].load_s == pytest.approx(0.02) and costs["a"].load_s == 0
    compute_only = {n: c.ttft_s + {"a": 6, "b": 2}[n] * c.prefill_s for n, c in costs.items()}
    assert compute_only["b"] < compute_only["a"] / (1 + params.tie_tolerance)
    # no decodes beside b: the load stalls nobody, the lower TTFT wins
    b.decodes = 0
    d = choose([a, b], [a, b], {0: 32}, 32, N, params, SLO, now=0.0)
    assert isinstance(d, Decision) and d.prefill is b


def test_work_weight_keeps_a_prefix_where_its_first_prefill_is_still_running() -> None:
    """``a`` holds the prompt's prefix (the router marked it resident at the first
    dispatch) while that first, uncached prefill still runs there; ``b`` is idle. On TTFT
    alone ``b`` recomputes the whole prefix a little sooner than ``a`` finishes the first
    one, and each such request adds a cold copy of the prefix to the fleet. ``work_weight``
    charges the request's own compute: ``a``'s hit costs almost none, so it waits there."""
    a, b = inst("a", 0), inst("b", 1)
    cold = PROFILE.prefill_s(N, 0)
    a.enqueue("first", cold * 1.05, now=0.0)  # the first prefill of the prefix, queued
    runs = {0: 32}
    blind = replace(PARAMS, work_weight=0.0)
    d = choose([a, b], [a, b], runs, 0, N, blind, SLO, now=0.0)
    assert isinstance(d, Decision) and d.prefill is b and d.hit_tokens == 0
    weighed = PARAMS  # the default: 1
    d = choose([a, b], [a, b], runs, 0, N, weighed, SLO, now=0.0)
    assert isinstance(d, Decision) and d.prefill is a and d.hit_tokens == 32 * BS
    costs = {c.name: c for c in d.candidates}
    assert costs["b"].ttft_s < costs["a"].ttft_s  # the lower TTFT lost to the compute
    # the weight does not send a cheap request to a long queue: a short wait elsewhere
    # with the prefix in the store beats a's queue
    d = choose([a, b], [a, b], runs, 32, N, weighed, SLO, now=0.0)
    assert isinstance(d, Decision) and d.prefill is b and d.load_blocks == 32
    with pytest.raises(ValueError, match="work_weight"):
        RouterConfig.from_dict({"model": "m", "tokenizer": "x", "cost": {"work_weight": -1}})


def test_a_prefix_on_its_way_into_the_store_is_waited_for_and_loaded() -> None:
    """``a`` runs the first prefill of a prefix and has more queued behind it; ``b`` and
    ``c`` are idle. Without the landing the follower's choices are ``a``'s queue or
    computing the prefix cold; with it, an idle instance waits until the first prefill
    stores the prefix, then loads it: sooner than ``a`` and no cold copy."""
    a, b, c = inst("a", 0), inst("b", 1), inst("c", 2)
    cold = PROFILE.prefill_s(N, 0)
    a.enqueue("first", cold, now=0.0)
    for i in range(4):  # hits of the prefix queued behind it
        a.enqueue(f"hit{i}", 0.3 * cold, now=0.0)
    runs = {0: 32}
    first_ends = Landing(32, cold, ("first",))
    blind = choose([a, b, c], [a, b, c], runs, 0, N, PARAMS, SLO, now=0.0)
    assert isinstance(blind, Decision) and blind.prefill is not a and blind.hit_tokens == 0
    d = choose([a, b, c], [a, b, c], runs, 0, N, PARAMS, SLO, now=0.0, landing=first_ends)
    assert isinstance(d, Decision) and d.prefill is not a and d.awaits == first_ends
    assert d.hit_tokens == 32 * BS and d.load_blocks == 32 and d.local_blocks == 0
    costs = {cost.name: cost for cost in d.candidates}
    assert costs[d.prefill.name].waits and costs[d.prefill.name].queue_s == pytest.approx(cold)
    assert d.ttft_s < costs["a"].ttft_s  # sooner than a's queue
    assert d.work_s < blind.work_s / 4  # and a load, not a cold prefill
    # a landing the holder itself computes changes nothing for it
    assert not costs["a"].waits
    # a landing far in the future is not waited for: computing now is sooner and cheaper
    late = Landing(32, 50 * cold, ("first",))
    d = choose([a, b, c], [a, b, c], runs, 0, N, PARAMS, SLO, now=0.0, landing=late)
    assert isinstance(d, Decision) and d.awaits is None and d.hit_tokens == 0
    # nor one that adds nothing to what the store already holds
    d = choose([a, b, c], [a, b, c], runs, 32, N, PARAMS, SLO, now=0.0,
               landing=Landing(32, cold, ("first",)))
    assert isinstance(d, Decision) and d.awaits is None and d.load_blocks == 32


def test_a_wait_that_breaks_the_slo_loses_to_computing_within_it() -> None:
    """Waiting for a landing scores lower (no compute) but would miss the TTFT SLO that
    computing now meets: the instance computes now. Past the SLO either way, the wait is
    queue time like any other and a refusal says so."""
    b = inst("b", 1)
    cold = PROFILE.prefill_s(N, 0)
    slo = SloConfig(ttft_ms=1000 * (cold + 0.3), tbt_ms=100)
    landing = Landing(32, cold + 0.5, ("x",))  # scores below cold + cold: preferred
    free = choose([b], [b], {}, 0, N, PARAMS, SloConfig(ttft_ms=1e6, tbt_ms=100), now=0.0,
                  landing=landing)
    assert isinstance(free, Decision) and free.awaits == landing
    d = choose([b], [b], {}, 0, N, PARAMS, slo, now=0.0, landing=landing)
    assert isinstance(d, Decision) and d.awaits is None and d.hit_tokens == 0
    b.enqueue("busy", 3.0, now=0.0)  # now both miss: the lower score, refused by queue
    r = choose([b], [b], {}, 0, N, PARAMS, slo, now=0.0, landing=landing)
    assert isinstance(r, Rejection) and r.reason == "ttft"
