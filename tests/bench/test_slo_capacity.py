"""Capacity under SLO (issue 46 item 1): the paper's TBT, the effective fraction, the
interpolated capacity, the simulated workloads at a chosen rate, and a whole sweep."""

from __future__ import annotations

import gzip
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks.lib import capacity as cap
from benchmarks.serving import slo_capacity
from benchmarks.sim import workloads as wl
from benchmarks.sim.cluster import BLOCK, Request


def test_paper_tbt_is_the_mean_of_the_longest_tenth_of_the_gaps() -> None:
    assert cap.paper_tbt([float(x) for x in range(1, 21)]) == 19.5  # 20 and 19
    assert cap.paper_tbt([0.1, 0.5, 0.2]) == 0.5  # at least one gap
    assert cap.paper_tbt([]) == 0.0


def test_a_request_is_effective_only_when_served_within_both_slos() -> None:
    slo = cap.Slo(1.0, 0.1)
    assert slo.meets(1.0, 0.1)
    assert not slo.meets(1.01, 0.05)
    assert not slo.meets(0.5, 0.11)
    assert not slo.meets(None, 0.0)
    with pytest.raises(ValueError, match="SLOs must be > 0"):
        cap.Slo(0.0, 0.1)


def test_a_rate_point_counts_refused_and_failed_requests_as_misses() -> None:
    outs = [cap.Served(0.5, 0.05, 1000, 600, 200), cap.Served(2.0, 0.05, 1000),
            cap.Served(None, 0.0, 1000, rejected=True), cap.Served(None, 0.0, 1000)]
    row = cap.rate_point(outs, cap.Slo(1.0, 0.1), offered_rps=4.0, duration_s=2.0)
    assert row["effective_fraction"] == 0.25
    assert row["goodput_rps"] == 0.5
    assert (row["rejected"], row["failed"]) == (1, 1)
    assert row["ttft_mean_s"] == 1.25  # of the served only
    assert row["engine_hit_share"] == 0.3 and row["store_hit_share"] == 0.1
    assert row["miss_share"] == pytest.approx(0.6)
    with pytest.raises(ValueError, match="needs requests"):
        cap.rate_point([], cap.Slo(1.0, 0.1), 1.0, 1.0)


def test_capacity_is_interpolated_at_the_first_crossing() -> None:
    pts = [(1.0, 1.0), (2.0, 0.95), (4.0, 0.75), (8.0, 0.95)]  # a late recovery is noise
    c, how = cap.capacity_at(pts)
    assert how == "interpolated"
    assert c == pytest.approx(2.0 + 2.0 * (0.95 - 0.9) / (0.95 - 0.75))
    assert cap.capacity_at([(1.0, 0.5), (2.0, 0.2)]) == (None, "below")
    assert cap.capacity_at([(1.0, 0.99), (2.0, 0.95)]) == (2.0, "above")
    with pytest.raises(ValueError, match="two points at one rate"):
        cap.capacity_at([(1.0, 1.0), (1.0, 0.5)])


def test_rows_are_medians_over_repetitions_with_their_range() -> None:
    reps: list[list[dict[str, Any]]] = [
        [{"offered_rps": 1.0, "effective_fraction": f, "ttft_mean_s": t, "note": "x"},
         {"offered_rps": 2.0, "effective_fraction": f / 2, "ttft_mean_s": None}]
        for f, t in ((1.0, 0.2), (0.8, 0.4), (0.9, 0.3))]
    a = cap.arm_capacity(reps)
    first = a["rows"][0]
    assert first["effective_fraction"] == 0.9 and first["effective_fraction_range"] == [0.8, 1.0]
    assert first["ttft_mean_s"] == 0.3 and first["reps"] == 3
    assert a["rows"][1]["ttft_mean_s"] is None
    assert a["capacity_rps_reps"][1] is None  # 0.8 at the lowest rate: below
    assert a["capacity_found"] == "interpolated"


def test_figure5_ordering_needs_a_strict_order_and_the_margin() -> None:
    order = ("random", "lb", "local", "global")
    assert cap.figure5_ordering({"random": 9, "lb": 5, "local": 3, "global": 2.7}, order)
    assert not cap.figure5_ordering({"random": 9, "lb": 5, "local": 3, "global": 2.8}, order)
    assert not cap.figure5_ordering({"random": 4, "lb": 5, "local": 3, "global": 1}, order)
    assert cap.figure5_ordering({"random": 9, "lb": 5, "local": 3}, order) is None


def _rate(reqs: list[Request]) -> float:
    return (len(reqs) - 1) / (reqs[-1].t - reqs[0].t)


def test_a_trace_is_replayed_at_the_offered_rate_in_its_own_pattern() -> None:
    reqs = [Request(t, 600, 10, (i,)) for i, t in enumerate((0.0, 1.0, 1.0, 5.0))]
    fast = wl.trace(reqs, 3.0)
    assert _rate(fast) == pytest.approx(3.0)
    assert [r.t for r in fast] == pytest.approx([0.0, 0.2, 0.2, 1.0])
    assert [r.blocks for r in fast] == [r.blocks for r in reqs]
    with pytest.raises(ValueError, match="rate must be > 0"):
        wl.trace(reqs, 0.0)


def test_hot_prefix_requests_share_their_group_prefix_and_arrive_at_the_rate() -> None:
    spec = wl.HotPrefix(groups=4, prefix_tokens=4 * BLOCK, question_tokens=BLOCK)
    reqs = spec.build(4000, 20.0, seed=1)
    assert _rate(reqs) == pytest.approx(20.0, rel=0.05)
    prefixes = {r.blocks[:4] for r in reqs}
    assert len(prefixes) == 4
    assert len({r.blocks[4] for r in reqs}) == len(reqs)  # every question its own
    assert reqs == spec.build(4000, 20.0, seed=1)


def test_agentic_turns_extend_their_session_and_share_the_system_prompt() -> None:
    spec = wl.Agentic(system_tokens=4 * BLOCK, first_tokens=2 * BLOCK,
                      turn_tokens=BLOCK, output_tokens=BLOCK // 2, max_turns=6)
    reqs = spec.build(3000, 10.0, seed=0)
    assert len(reqs) >= 3000
    assert all(r.blocks[:4] == reqs[0].blocks[:4] for r in reqs)
    firsts = [r for r in reqs if r.n == 6 * BLOCK]
    later = [r for r in reqs if r.n > 6 * BLOCK]
    assert firsts and later
    # every later turn's blocks extend an earlier turn's of its session
    by_block: dict[int, list[Request]] = {r.blocks[4]: [] for r in firsts}
    for r in sorted(reqs, key=lambda r: r.n):
        by_block[r.blocks[4]].append(r)
    for turns in by_block.values():
        for a, b in zip(turns, turns[1:]):
            assert b.blocks[:len(a.blocks)] == a.blocks and b.t > a.t
    assert _rate(reqs) == pytest.approx(10.0, rel=0.15)


def _doc(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "r.json"
    assert slo_capacity.main(["hotprefix", "--instances", "4", "--requests", "400",
                              "--out", str(out), *args]) == 0
    return json.loads(out.read_text())


def test_a_sweep_brackets_every_arms_capacity_and_writes_the_result(tmp_path: Path) -> None:
    doc = _doc(tmp_path, "--reps", "2", "--arms", "random_nostore,engine_cache_store,kvcentric",
               "--start-rates", "2")
    s = doc["summary"]
    assert s["workload"] == "hotprefix" and s["instances"] == 4 and s["reps"] == 2
    rates = s["rates"]
    assert len(rates) >= 3  # two to start, more until every arm's crossing is inside
    for arm in doc["arms"]:
        rows = arm["rows"]
        own = [r["offered_rps"] for r in rows]
        assert set(rates) <= set(own) and own == sorted(own)
        assert all(r["reps"] == 2 for r in rows)
        assert rows[0]["effective_fraction"] >= cap.THRESHOLD > rows[-1]["effective_fraction"]
        c = arm["summary"]["capacity_rps"]
        assert arm["summary"]["capacity_found"] == "interpolated"
        assert rates[0] <= c <= rates[-1]
        # refined twice: the crossing lies between two of its rates 1.5 ** 0.25 apart
        fr = [r["effective_fraction"] for r in rows]
        k = next(i for i, f in enumerate(fr) if f < cap.THRESHOLD)
        assert own[k] / own[k - 1] == pytest.approx(slo_capacity.STEP ** 0.25)
        assert own[k - 1] <= c <= own[k]
    caps = s["capacity_rps"]
    assert s["best_baseline"] in ("random_nostore", "engine_cache_store")
    assert s["best_ours"] == "kvcentric"
    assert s["ours_over_best_baseline"] == pytest.approx(
        caps["kvcentric"] / max(caps["random_nostore"], caps["engine_cache_store"]))
    assert s["figure5_ordering_holds"] is None  # its arms were not all run
    assert (tmp_path / "r_effective.png").stat().st_size > 0
    assert (tmp_path / "r_cdf.png").stat().st_size > 0


def test_given_rates_are_swept_as_given_and_warm_up_is_not_counted(tmp_path: Path) -> None:
    doc = _doc(tmp_path, "--reps", "1", "--arms", "round_robin", "--rates", "1,2",
               "--warmup", "0.25")
    assert doc["summary"]["rates"] == [1.0, 2.0]
    assert [r["requests"] for r in doc["arms"][0]["rows"]] == [300, 300]


def test_bad_arguments_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        slo_capacity.main(["hotprefix", "--arms", "nope"])
    assert "unknown arms ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        slo_capacity.main(["hotprefix", "--warmup", "1"])
    assert "--warmup must be in [0, 1)" in capsys.readouterr().err


def test_nominal_capacity_is_the_prefill_instances_over_one_uncached_prefill() -> None:
    cfg = slo_capacity.SimConfig(prefill=4)
    reqs = [Request(0.0, n, 1, ()) for n in (1000, 3000)]
    assert slo_capacity.nominal_rps(cfg, reqs) == pytest.approx(
        4 / cfg.prefill_s(round(statistics.fmean((1000, 3000))), 0))


def test_with_a_disk_tier_the_tier_blind_arms_run_beside_ours(tmp_path: Path) -> None:
    doc = _doc(tmp_path, "--reps", "1", "--rates", "2,200", "--disk-blocks", "4096",
               "--store-blocks", "64")
    labels = [a["label"] for a in doc["arms"]]
    assert {"kvcentric_tierblind", "kvcentric_noreject_tierblind"} <= set(labels)
    s = doc["summary"]
    assert s["best_baseline"] is not None and not s["best_baseline"].startswith("kvcentric")
    assert set(s["tier_aware_over_blind"]) == {"kvcentric", "kvcentric_noreject"}
    assert doc["config"]["disk_blocks"] == 4096
    plain = _doc(tmp_path, "--reps", "1", "--rates", "2,200")
    assert not any(a["label"].endswith("_tierblind") for a in plain["arms"])
    assert plain["summary"]["tier_aware_over_blind"] is None


def test_ours_without_the_store_runs_only_on_request() -> None:
    plain = slo_capacity.default_arms(slo_capacity.SimConfig())
    assert "kvcentric" in plain and "local_cache_aware" in plain
    assert not any(a.endswith("_nostore") and a.startswith("kvcentric") for a in plain)
    assert not any(a.endswith("_tierblind") for a in plain)
    tiered = slo_capacity.default_arms(slo_capacity.SimConfig(disk_blocks=8))
    assert set(tiered) - set(plain) == {"kvcentric_tierblind", "kvcentric_noreject_tierblind"}


# serial (tests/helpers/xdist_groups.py): the emulated fleet runs in wall time at dilation
# 1.5 against a 0.1 s TTFT SLO; a pause of a tenth of a second beside an engine start
# makes a light-load request miss it
@pytest.mark.serial
def test_the_emulated_fleet_sweeps_real_requests_in_emulated_time(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    assert slo_capacity.main([
        "hotprefix", "--engine", "emulator", "--instances", "2", "--arms", "round-robin",
        "--rates", "10,2000", "--requests", "48", "--reps", "1", "--scale-tokens", "0.05",
        "--pages", "64", "--max-output", "8", "--dilation", "1.5", "--slo-ttft-s", "0.1",
        "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["engine"] == "emulator" and s["dilation"] == 1.5 and s["best_ours"] is None
    rows = doc["arms"][0]["rows"]
    assert [r["offered_rps"] for r in rows] == [10.0, 2000.0]
    light, flood = rows
    assert light["requests"] == flood["requests"] == 38  # 48 but the first fifth
    # light load: (nearly) every request effective, the capacity's 90% at least, though
    # a busy test box can push a request's wall-clock TTFT past the 0.15 s SLO; a flood
    # of two engines queues past it
    assert light["effective_fraction"] >= 0.9 > flood["effective_fraction"]
    assert flood["ttft_mean_s"] > light["ttft_mean_s"]
    assert 0 < light["tbt_p90_s"] < 1.0
    # where TBT misses come from: the engines' own token gaps, beside the client's
    assert 0 < light["engine_tbt_p90_s"] < 1.0
    assert 0 <= light["engine_tbt_miss_share"] <= 1 and 0 <= light["tbt_miss_share"] <= 1
    assert light["engine_requests_max_over_mean"] >= 1.0
    # the engines' own account: a group's prefix is computed once, then hit
    assert light["engine_hit_share"] > 0 and light["store_hit_share"] >= 0
    assert light["miss_share"] == pytest.approx(
        1 - light["engine_hit_share"] - light["store_hit_share"])
    assert 0 < light["miss_share"] < 1
    # the rate the counted requests arrived at: the offered one at light load
    assert light["achieved_rps"] == pytest.approx(10.0, rel=0.5)
    assert flood["achieved_rps"] > light["achieved_rps"]
    assert doc["arms"][0]["summary"]["capacity_found"] == "interpolated"
    # each run's engine records are its own: the flood's requests (the same sessions as
    # the light run's, on the same engines) each ran on one engine, not on two
    with gzip.open(tmp_path / "fleet_requests.jsonl.gz", "rt") as f:
        per_request = [json.loads(line) for line in f]
    for rate in (10.0, 2000.0):
        served = [r for r in per_request if r["rate"] == rate and r["status"] == 200]
        assert served and all(len(r["engines"]) == 1 for r in served), rate



def test_the_coding_agents_sessions_arrive_over_several_session_lengths() -> None:
    """A run of the coding agent whose sessions all arrive before the first one ends
    offers the engines the sessions' own pace, whatever the rate: past the rate its
    requests allow, the emulated agent gets more sessions, arriving over
    ``AGENT_SPAN_SESSIONS`` session lengths (turns times think time)."""
    from benchmarks.serving import slo_fleet

    turns, think = slo_fleet.AGENT["turns_mean"], slo_fleet.AGENT["think_s"]
    session_s = turns * think
    assert slo_fleet.agent_sessions(1000, 1.0) == round(1000 / turns)  # slow: as asked
    for rate in (10.0, 45.0, 152.0):
        n = slo_fleet.agent_sessions(1000, rate)
        arrival_s = n / (rate / turns)  # sessions arrive at rate / turns a second
        assert arrival_s >= slo_fleet.AGENT_SPAN_SESSIONS * session_s
        assert n * turns >= 1000
    assert slo_fleet.agent_sessions(0, 0.0) == 1


def test_a_pd_arm_splits_the_fleet_and_hands_each_prompt_over_through_the_store(
        tmp_path: Path) -> None:
    """``kvcentric-pd50`` over two emulated engines: our router prefills on the first and
    decodes on the second, which loads each prompt's KV from the store instead of
    recomputing it; reuse is counted on the prefill side only (a decode loading what its
    prefill just computed would otherwise count as a hit). Structure only, no timing: the
    SLOs are out of reach of any delay."""
    out = tmp_path / "pd.json"
    assert slo_capacity.main([
        "hotprefix", "--engine", "emulator", "--instances", "2", "--arms",
        "kvcentric-pd50,round-robin", "--rates", "5", "--requests", "32", "--reps", "1",
        "--scale-tokens", "0.05", "--pages", "256", "--max-output", "8", "--dilation", "1.5",
        "--slo-ttft-s", "600", "--slo-tbt-s", "60", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {a["label"]: a["rows"][0] for a in doc["arms"]}
    pd, rr = rows["kvcentric-pd50"], rows["round-robin"]
    assert pd["effective_fraction"] == rr["effective_fraction"] == 1.0
    # the decode engine loaded nearly every prompt token (all but each prompt's last,
    # partial block), the prefill engine computed them: the hand-over went through
    assert pd["pd_transfer_share"] > 0.6 and rr["pd_transfer_share"] is None
    # a hot prefix is reused on the prefill side, and its reuse is not double counted
    assert 0 < pd["engine_hit_share"] + pd["store_hit_share"] < 1
    assert pd["miss_share"] > 0
    assert doc["summary"]["best_ours"] == "kvcentric-pd50"
    # each run's fleet numbers: the swept rate's and the TTFT CDF's, for both arms
    assert {(r["arm"], r["rate"]) for r in doc["runs"]} >= {("kvcentric-pd50", 5.0),
                                                            ("round-robin", 5.0)}
    # every request in the per-request file: where it ran, and our router's prediction
    per = doc["per_request"]
    lines = gzip.decompress((tmp_path / per["file"]).read_bytes()).decode().splitlines()
    reqs = [json.loads(x) for x in lines]
    by_arm = {a: [r for r in reqs if r["arm"] == a and r["rate"] == 5.0]
              for a in ("kvcentric-pd50", "round-robin")}
    n = len(by_arm["round-robin"])  # the workload's requests, every one in each run
    assert n >= 32 and per["rows"] == len(reqs) == n * len(doc["runs"])
    assert all(len(v) == n and sum(not r["counted"] for r in v) == round(0.2 * n)
               for v in by_arm.values())
    # a P/D request ran on both engines, the prefill first; round robin's on one
    engines = {tuple(r["engines"]) for r in by_arm["kvcentric-pd50"]}
    assert len(engines) == 1 and len(next(iter(engines))) == 2, engines
    assert all(len(r["engines"]) == 1 for r in by_arm["round-robin"])
    assert {r["engines"][0] for r in by_arm["round-robin"]} == {
        *next(iter(engines))}  # both engines served it, in turn
    assert all(r["predicted_ttft_s"] is not None and r["ttft_s"] > 0
               for r in by_arm["kvcentric-pd50"])
    assert all(r["predicted_ttft_s"] is None for r in by_arm["round-robin"])

class _Fixed:
    """An engine whose arms hold up to a capacity (``inf``: always, 0: never)."""

    def __init__(self, caps: dict[str, float]) -> None:
        self.caps = caps
        self.arms = list(caps)

    def point(self, arm: str, rate: float, rep: int
              ) -> tuple[dict[str, Any], list[cap.Served]]:
        f = 1.0 if rate <= self.caps[arm] else 0.5
        return {"offered_rps": rate, "effective_fraction": f}, []


def test_an_arm_that_never_holds_does_not_stop_the_sweep_going_up() -> None:
    sw = slo_capacity.Sweep(_Fixed({"hopeless": 0.0, "strong": 20.0}), reps=1, fixed=False,
                            max_rates=14, progress=lambda _: None)
    sw.run([1.0, 1.5])
    rates = sw.rates
    assert min(rates) >= 1.0 / 2 ** slo_capacity.LOWEST_HALVINGS  # it stopped looking down
    assert max(rates) > 20.0  # and went past the strong arm's capacity
    assert sw.arm("hopeless")["capacity_found"] == "below"
    assert sw.arm("strong")["capacity_found"] == "interpolated"


class _Scripted:
    """One arm that holds (effective fraction 1.0, else 0.5) where ``holds(rate, rep)``
    says; records every (rate, rep) it runs."""

    arms = ["a"]

    def __init__(self, holds: Callable[[float, int], bool]) -> None:
        self.holds = holds
        self.ran: list[tuple[float, int]] = []

    def point(self, arm: str, rate: float, rep: int
              ) -> tuple[dict[str, Any], list[cap.Served]]:
        self.ran.append((rate, rep))
        frac = 1.0 if self.holds(rate, rep) else 0.5
        return {"offered_rps": rate, "effective_fraction": frac}, []


def test_the_rates_that_decide_a_capacity_get_every_repetition_the_others_fewer() -> None:
    # holds up to 5 req/s, except that at 4 req/s only its first repetition holds
    eng = _Scripted(lambda rate, rep: rate <= 5.0 and not (rate == 4.0 and rep > 0))
    sw = slo_capacity.Sweep(eng, reps=3, fixed=True, max_rates=14,
                            progress=lambda _: None, sweep_reps=1)
    sw.run([1.0, 2.0, 4.0, 8.0, 16.0])
    assert sorted(eng.ran) == [(r, 0) for r in (1.0, 2.0, 4.0, 8.0, 16.0)]
    sw.confirm()
    # 4 and 8 decided it after one repetition; their medians moved the crossing to 2-4
    counts = {r: sum(1 for x, _ in eng.ran if x == r) for r in sw.rates}
    assert counts == {1.0: 1, 2.0: 3, 4.0: 3, 8.0: 3, 16.0: 1}
    assert len(set(eng.ran)) == len(eng.ran)  # no repetition ran twice
    out = sw.arm("a")
    assert [row["reps"] for row in out["rows"]] == [1, 3, 3, 3, 1]
    assert sw.deciding("a") == [2.0, 4.0]
    assert out["capacity_rps"] is not None and 2.0 <= out["capacity_rps"] < 4.0


def test_a_lowest_rate_that_misses_once_is_repeated_before_it_decides_below() -> None:
    """A miss at the lowest rate makes the capacity "below" whatever the rates above
    say, so that rate decides it and gets every repetition; here their median holds,
    and the crossing above it is confirmed instead."""
    # holds up to 5 req/s, except its first run at the lowest rate: one unlucky run
    eng = _Scripted(lambda rate, rep: rate <= 5.0 and (rate, rep) != (1.0, 0))
    sw = slo_capacity.Sweep(eng, reps=3, fixed=True, max_rates=14,
                            progress=lambda _: None, sweep_reps=1)
    sw.run([1.0, 2.0, 4.0, 8.0])
    assert sw.deciding("a") == [1.0]
    assert sw.arm("a")["capacity_found"] == "below"
    sw.confirm()
    counts = {r: sum(1 for x, _ in eng.ran if x == r) for r in sw.rates}
    assert counts == {1.0: 3, 2.0: 1, 4.0: 3, 8.0: 3}
    out = sw.arm("a")
    assert out["capacity_found"] == "interpolated" and 4.0 <= out["capacity_rps"] < 8.0


def test_figure5s_baselines_have_no_global_pool_and_only_an_emulated_fleet_runs_them(
        tmp_path: Path) -> None:
    """The paper's random, load-balancing and local cache-aware schedulers reuse each
    instance's own cache; global cache-aware (Algorithm 1) has the store; local
    cache-aware is Algorithm 1 without it."""
    from benchmarks.serving import slo_fleet
    from benchmarks.serving.fleet import FleetSpec, fleet

    *local, global_ = slo_fleet.FIGURE5
    assert all(not slo_fleet.ARMS[a].shared_store for a in local)
    assert slo_fleet.ARMS[global_].shared_store
    assert local[-1] == "kvcentric-router-nostore"  # Algorithm 1, engine caches only
    ours_local = slo_fleet.ARMS[local[-1]]
    assert not ours_local.shared_store and local[-1] in slo_fleet.OURS
    assert ours_local.gateway_opts == slo_fleet.ARMS[global_].gateway_opts
    assert {slo_fleet.ARMS[a].gateway_opts["policy"] for a in local[:-1]} == {
        "random", "least_loaded"}
    assert not slo_fleet.ARMS["kvcentric-engine_cache-nostore"].shared_store
    with pytest.raises(ValueError, match="emulated fleets"):
        with fleet(FleetSpec("m"), slo_fleet.ARMS[local[0]], tmp_path):
            pass


def test_our_router_is_given_the_engines_context_not_the_tokenizers() -> None:
    """The bench model's config.json names 32768 tokens; engines emulating Llama-3.1-8B
    serve 131072. Without the engines' context our router alone refused the trace's
    long prompts (400s counted as misses) that the peers' routers passed through."""
    from benchmarks.emulator.launch import EmulatorSpec
    from benchmarks.serving.fleet_runs import FleetSetup

    setup = FleetSetup(EmulatorSpec(2, "tok", max_model_len=131072), 1000.0, 100.0,
                       router_extra={"replication": {"enabled": True}})
    assert setup.our_sections() == {"limits": {"max_model_len": 131072},
                                    "replication": {"enabled": True}}
    assert setup.our_sections({"limits": {"max_model_len": 8}})["limits"] == {
        "max_model_len": 8}
