"""How does our connector serve multi-turn load next to vLLM's MooncakeStoreConnector?

Multi-turn serving through vLLM: no connector vs vLLM's MooncakeStoreConnector vs ours,
the last two on Mooncake Stores set up the same way, in one run.

    python -m benchmarks.serving.connectors [--quick] [--repeats N] [--arms A,B,...]
                                          [--profile-calls] [--out FILE.json]

One vLLM CPU server per arm (``bench`` model, float32, the same worker threads and the
same small KV cache in every arm) serves the same conversations. Arms run one at a time,
each on a fresh Mooncake cluster (so every arm starts from an empty store and no idle
server's threads share the two cores with the measured one), ``--repeats`` times in a
rotating order; per request, TTFT is the median over repeats:

- ``no_connector``: vLLM with prefix caching only;
- ``mooncake_store_connector``: vLLM's built-in ``MooncakeStoreConnector`` (config via
  ``MOONCAKE_CONFIG_PATH``, ``standalone-store`` mode: the engine is a pure client and a
  storage node holds the memory);
- ``kvcentric``: our connector with the ``mooncake`` backend, also a pure client of a
  master and node set up the same way; loads stream layer by layer (``ranged_reads``);
- ``kvcentric_whole_get`` (``--arms`` only): the same with ``ranged_reads`` off (one whole
  ``batch_get_into`` per step before the forward pass), to show what streaming buys;
- ``lmcache`` (``--arms``; needs ``python -m benchmarks.serving.lmcache_peer setup``): LMCache
  0.5.6's ``LMCacheMPConnector`` against a fresh ``lmcache server`` (its own memory, 256-token
  chunks), from its own venv with the same vLLM and torch.

Workload: ``users`` conversations share a system prompt; each has its own document and
``turns`` turns (a new message, then a greedy answer that joins the history). Turns are
served round-robin over users, one request at a time, and the engine's KV cache holds
less than the users' histories together, so by a user's next turn the engine has evicted
that history: without a store it is recomputed, with one it is loaded. Measured per arm:
TTFT (streamed, first token) mean and p90, throughput (requests and generated tokens per
second of the arm's own request time), and the prompt tokens served from
the engine's prefix cache and from the connector (``hit_tokens`` = both). Generated tokens
are compared with the ``no_connector`` arm's. An arm that cannot run is reported failed,
with the reason, never with made-up numbers.

``--profile-calls`` times every Mooncake store call both connectors make, at the same
boundary (``benchmarks/serving/mooncake_timing``), and reports calls and milliseconds per request.

Everything Mooncake runs in a private network namespace (its listeners bind all
interfaces); the vLLM servers run inside it too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.lib import results_writer
from benchmarks.lib.paths import RESULTS
from benchmarks.micro.store_mooncake import MASTER, start_cluster, start_node
from benchmarks.serving import lmcache_peer, work
from benchmarks.serving.connectors_report import ARMS, plot, print_table, summarise
from benchmarks.serving.lmcache_peer import LMCacheServer
from kvcentric.testing.models import build_model
from kvcentric.testing.netns import NetNamespace
from kvcentric.testing.servers import VllmServer, connector_config

DEFAULT_ARMS = ARMS[:3]
PAGE = 128  # vLLM CPU block size; both connectors store 128-token blocks
MASTER_METRICS = "http://127.0.0.1:9003/metrics"  # the cluster's master, in the namespace
# float32: a stored block then holds exactly the bytes a recompute would produce, so every
# arm must answer the same greedy tokens (in bf16, recompute and reuse round differently
# and a random model's near-tied logits amplify that into different tokens)
DTYPE = "float32"


@dataclass(frozen=True)
class Workload:
    users: int
    turns: int
    system_len: int
    doc_len: int
    msg_len: int
    answer_len: int
    engine_blocks: int  # engine KV cache size in 128-token blocks (below the histories)
    max_len: int

    def prompts(self, seed: int = 7) -> tuple[list[int], list[list[int]], list[list[list[int]]]]:
        rnd = random.Random(seed)

        def toks(n: int) -> list[int]:
            return [rnd.randrange(4, 8000) for _ in range(n)]

        return (toks(self.system_len), [toks(self.doc_len) for _ in range(self.users)],
                [[toks(self.msg_len) for _ in range(self.turns)] for _ in range(self.users)])


QUICK = Workload(users=3, turns=4, system_len=256, doc_len=1024, msg_len=128, answer_len=16,
                 engine_blocks=24, max_len=2048)
FULL = Workload(users=4, turns=4, system_len=512, doc_len=2048, msg_len=256, answer_len=32,
                engine_blocks=40, max_len=4096)


ENGINE_PHASES = ("queue", "prefill")  # vLLM's per-request phase histograms, in ms per request


def counters(server: VllmServer) -> dict[str, float]:
    """Hit counters, every connector counter (ours: ``vllm:kvcentric_*``) for the profile
    of where a hit's time goes, and the sums and counts of vLLM's queue and prefill time
    histograms (``*_sum`` / ``*_count``)."""
    m = server.metrics()
    out = {"engine_hit_tokens": m.get("vllm:prefix_cache_hits_total", 0.0),
           "external_hit_tokens": m.get("vllm:external_prefix_cache_hits_total", 0.0),
           "prompt_tokens": m.get("vllm:prompt_tokens_total", 0.0)}
    for name, value in m.items():
        if "{" not in name and ("kvcentric" in name or "mooncake" in name.lower()):
            out[name] = value
    for phase in ENGINE_PHASES:
        for part in ("sum", "count"):
            out[f"{phase}_{part}"] = m.get(f"vllm:request_{phase}_time_seconds_{part}", 0.0)
    return out


def after_request(server: VllmServer, before: dict[str, float],
                  timeout_s: float = 10.0) -> dict[str, float]:
    """``counters`` once vLLM has recorded the request that just finished (its phase
    histograms are observed when the engine reports the request finished, a moment after
    the stream ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = counters(server)
        if now["queue_count"] > before["queue_count"] or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def request_split(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """One request's engine-side split in ms: ``queue`` (waiting: with vLLM's
    MooncakeStoreConnector this includes its load, which runs before the request is
    scheduled), ``prefill`` (scheduled to first token: the forward pass, and with ours
    the layers' loads it waits for), and ours' connector counters that grew."""
    out = {p: 1e3 * (after[f"{p}_sum"] - before[f"{p}_sum"]) for p in ENGINE_PHASES}
    for k, v in after.items():
        if k.startswith("vllm:kvcentric_") and k.endswith("_seconds_total"):
            out[k[len("vllm:kvcentric_"):-len("_seconds_total")]] = 1e3 * (v - before.get(k, 0))
    return out


@dataclass
class Arm:
    """One arm's runs (one per repeat) and how they combine."""

    name: str
    runs: list[dict[str, Any]] = field(default_factory=list)
    status: str = "ok"
    log_tail: str = ""

    def fail(self, exc: BaseException, log: Path | None) -> None:
        self.status = f"failed: {type(exc).__name__}: {exc}"
        self.log_tail = log.read_text(errors="replace")[-1500:] if log and log.exists() else ""

    def result(self) -> dict[str, Any]:
        """Per request the median TTFT over repeats and the figures built on it; ``valid``
        false (and ``invalid_reason``) when a repeat of a connector arm saved or loaded
        nothing by its own count."""
        if self.status != "ok" or not self.runs:
            return {"status": self.status, "log_tail": self.log_tail}
        done = [run.get("work") for run in self.runs]
        whys = [work.invalid(work.Work(**d), saves=True, loads=True) for d in done if d]
        why = next((f"a repeat {w}" for w in whys if w), None)
        # per request, the median over repeats: one slow repeat moves no request's TTFT
        t = [statistics.median(r) for r in zip(*(run["ttft_s"] for run in self.runs))]
        p90 = statistics.quantiles(t, n=10)[-1] if len(t) > 1 else t[0]
        first = self.runs[0]["counters"]
        own = ("engine_hit_tokens", "external_hit_tokens", "prompt_tokens")
        totals = {k: sum(run["counters"].get(k, 0.0) for run in self.runs) for k in first
                  if k not in own}
        hits = [run["counters"]["engine_hit_tokens"] + run["counters"]["external_hit_tokens"]
                for run in self.runs]
        busy = sum(run["busy_s"] for run in self.runs)
        split = [{k: statistics.median(s[k] for s in reqs) for k in reqs[0]}
                 for reqs in zip(*(run["engine_split_ms"] for run in self.runs))]
        return {"status": "ok", "repeats": len(self.runs), "ttft_ms": [1e3 * x for x in t],
                "ttft_ms_runs": [[1e3 * x for x in run["ttft_s"]] for run in self.runs],
                "ttft_mean_ms": 1e3 * statistics.mean(t), "ttft_p90_ms": 1e3 * p90,
                "ttft_median_ms": 1e3 * statistics.median(t),
                "requests_per_s": sum(len(run["ttft_s"]) for run in self.runs) / busy,
                "output_tokens_per_s": sum(len(o) for run in self.runs
                                           for o in run["outputs"]) / busy,
                "hit_tokens": hits[0], "hit_tokens_runs": hits,
                **{k: first[k] for k in own},
                "outputs_same_every_repeat": all(run["outputs"] == self.runs[0]["outputs"]
                                                 for run in self.runs),
                "connector_counters_all_repeats": totals,
                "mooncake_calls_per_request": self.calls_per_request(),
                "engine_split_ms": split,
                "work_runs": done, "valid": why is None,
                **({"invalid_reason": why} if why else {}),
                "outputs": self.runs[0]["outputs"]}

    def calls_per_request(self) -> dict[str, dict[str, float]]:
        """Mooncake store calls (``--profile-calls``), per served request, over repeats."""
        n = sum(len(run["ttft_s"]) for run in self.runs)
        out: dict[str, dict[str, float]] = {}
        for run in self.runs:
            for name, (calls, secs) in run.get("mooncake_calls", {}).items():
                slot = out.setdefault(name, {"calls": 0.0, "ms": 0.0})
                slot["calls"] += calls / n
                slot["ms"] += 1e3 * secs / n
        return out


TIMING_SHIM = Path(__file__).parent / "mooncake_timing"


def call_totals(timing_dir: Path | None) -> dict[str, list[float]]:
    """Sum of the timing shim's per-process files: {method: [calls, seconds]}. Waits for
    the shim's once-a-second flush, so the snapshot includes every call made before it."""
    if timing_dir is None:
        return {}
    time.sleep(1.3)
    out: dict[str, list[float]] = {}
    for f in timing_dir.glob("*.json"):
        for name, (calls, secs) in json.loads(f.read_text()).items():
            slot = out.setdefault(name, [0, 0.0])
            slot[0] += calls
            slot[1] += secs
    return out


def serve(server: VllmServer, w: Workload, bar: tqdm, timing_dir: Path | None = None,
          read_work: Callable[[], work.Work] | None = None) -> dict[str, Any]:
    """The conversations on one server, round-robin over users, one request at a time;
    ``read_work``: the arm's own count of what it saved and loaded (:mod:`.work`), read
    before and after (``work`` in the run)."""
    system, docs, msgs = w.prompts()
    history = [system + d for d in docs]
    pre = counters(server)
    server.complete(random.Random(1).sample(range(4, 8000), 256), max_tokens=2)  # one-offs
    before = after_request(server, pre)
    work_before = read_work() if read_work is not None else None
    calls_before = call_totals(timing_dir)
    ttfts: list[float] = []
    outputs: list[list[int]] = []
    splits: list[dict[str, float]] = []
    busy = 0.0
    last = before
    for turn in range(w.turns):
        for u in range(w.users):
            prompt = history[u] + msgs[u][turn]
            t0 = time.perf_counter()
            ttft, toks = server.stream(prompt, max_tokens=w.answer_len, timeout_s=900)
            busy += time.perf_counter() - t0
            now = after_request(server, last)
            splits.append(request_split(last, now))
            last = now
            ttfts.append(ttft)
            outputs.append(toks)
            history[u] = prompt + toks
            bar.update()
    after = last
    calls = {k: [c - calls_before.get(k, [0, 0.0])[0], t - calls_before.get(k, [0, 0.0])[1]]
             for k, (c, t) in call_totals(timing_dir).items()}
    done = (read_work() - work_before).as_dict() \
        if read_work is not None and work_before is not None else None
    return {"ttft_s": ttfts, "outputs": outputs, "busy_s": busy, "engine_split_ms": splits,
            "counters": {k: after[k] - before.get(k, 0.0) for k in after},
            "mooncake_calls": {k: v for k, v in calls.items() if v[0]}, "work": done}


def work_reader(arm: str, server: VllmServer, lmc: LMCacheServer | None
                ) -> Callable[[], work.Work] | None:
    """Where ``arm`` counts its own saves and loads (None for ``no_connector``): ours on
    its vLLM, LMCache's server, the Mooncake master (and vLLM's external hits) for the
    built-in connector."""
    if arm == "lmcache" and lmc is not None:
        return lmc.work_done
    if arm == "mooncake_store_connector":
        return lambda: work.mooncake(work.fetch(MASTER_METRICS), server.metrics())
    if arm.startswith("kvcentric"):
        return lambda: work.ours(server.metrics(), PAGE)
    return None


def mooncake_json(path: Path) -> Path:
    """vLLM's MooncakeStoreConnector config: a pure client of our master, node holds memory."""
    path.write_text(json.dumps({
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
        "master_server_address": MASTER, "protocol": "tcp", "device_name": "",
        "global_segment_size": 0, "local_buffer_size": "512mb", "mode": "standalone-store"}))
    return path


def make_server(arm: str, model: str, w: Workload, env: dict[str, str], logs: Path,
                lmc: LMCacheServer | None = None, timing_dir: Path | None = None) -> VllmServer:
    args = ("--num-gpu-blocks-override", str(w.engine_blocks), "--block-size", str(PAGE))
    common: dict[str, Any] = {"model": model, "name": "bench", "dtype": DTYPE,
                              "max_model_len": w.max_len, "args": args,
                              "log_path": logs / f"connectors-{arm}.log"}
    if timing_dir is not None:
        path = os.pathsep.join(p for p in (str(TIMING_SHIM), os.environ.get("PYTHONPATH"))
                               if p)
        env = env | {"PYTHONPATH": path, "KVC_MOONCAKE_TIMING": str(timing_dir)}
    if arm == "no_connector":
        return VllmServer(**common, env=env)
    if arm == "lmcache":
        exe = lmcache_peer.python()
        assert lmc is not None and exe is not None
        return VllmServer(**common, env=env | lmcache_peer.ENV,
                          kv_transfer=lmc.transfer_config(), python=str(exe))
    if arm == "mooncake_store_connector":
        cfg = mooncake_json(logs / "connectors-mooncake.json")
        return VllmServer(**common, env=env | {"MOONCAKE_CONFIG_PATH": str(cfg)},
                          kv_transfer={"kv_connector": "MooncakeStoreConnector",
                                       "kv_role": "kv_both", "kv_connector_extra_config": {}})
    store = {"backend": "mooncake", "mooncake": {
        "master_server_address": MASTER, "metadata_server": "P2PHANDSHAKE", "use_env": False,
        "global_segment_size": 0, "staging_size": "512mb",
        "ranged_reads": arm != "kvcentric_whole_get"}}
    return VllmServer(**common, env=env,
                      kv_transfer=connector_config(store, block_size=PAGE, save_decode=False))


def run_arm(arm: Arm, ns: NetNamespace, model: str, w: Workload, env: dict[str, str],
            logs: Path, bar: tqdm, profile: bool = False) -> None:
    """One repeat of ``arm``: a fresh store (Mooncake master and node, or an lmcache
    server), its server, the workload."""
    cluster = Cluster(ns, logs, "2gb") if "connector" in arm.name or "kvcentric" in arm.name \
        else None
    lmc = None
    server: VllmServer | None = None
    timing = None
    if profile and cluster is not None:
        timing = logs / f"connectors-timing-{arm.name}-{len(arm.runs)}"
        timing.mkdir(parents=True, exist_ok=True)
    try:
        if arm.name == "lmcache":
            lmc = LMCacheServer(size_gb=2, log_path=logs / "connectors-lmcache-server.log")
            lmc.start()
        server = make_server(arm.name, model, w, env, logs, lmc, timing)
        server.start().wait_ready(900)
        arm.runs.append(serve(server, w, bar, timing, work_reader(arm.name, server, lmc)))
    except Exception as exc:  # an arm that cannot run is reported, never faked
        arm.fail(exc, server.log_path if server else logs / "connectors-lmcache-server.log")
    finally:
        if server is not None:
            server.stop()
        if lmc is not None:
            lmc.stop()
        if cluster is not None:
            cluster.stop()


class Cluster:
    """mooncake_master and one storage node, in the namespace this thread is in."""

    def __init__(self, ns: NetNamespace, logs: Path, segment: str) -> None:
        self.procs: list[subprocess.Popen[Any]] = start_cluster(ns, logs, "connectors")
        try:
            self.procs.append(start_node(ns, segment, logs, "connectors"))
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                    help=f"comma-separated subset of {','.join(ARMS)}")
    ap.add_argument("--repeats", type=int, default=2, help="runs of every arm (default 2)")
    ap.add_argument("--profile-calls", action="store_true",
                    help="time every Mooncake store call in both connectors' processes "
                    "(benchmarks/serving/mooncake_timing)")
    ap.add_argument("--summarise", type=Path, help="recompute summary, table and PNG of a "
                    "result JSON (no servers run)")
    args = ap.parse_args()
    if args.summarise:
        res = json.loads(args.summarise.read_text())
        res["summary"] = summarise(res["arms"], res["workload"]["users"])
        res.setdefault("meta", {})["summary_recomputed"] = {  # the runs' data stay as run
            "command": results_writer.command_line(__file__),
            "git": results_writer.git_state()}
        args.summarise.write_text(json.dumps(res, indent=1) + "\n")
        print_table(res)
        plot(res, args.summarise.with_suffix(".png"))
        return
    w = QUICK if args.quick else FULL
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("connectors-*"):  # servers append to their logs: start clean
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    reserved = "1" if (os.cpu_count() or 1) <= 2 else "0"
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": reserved, "VLLM_HOST_IP": "127.0.0.1"}
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown or args.repeats < 1:
        ap.error(f"unknown arms {sorted(unknown)}" if unknown else "--repeats must be >= 1")
    live = [Arm(a) for a in ARMS if a in args.arms.split(",")]
    total = args.repeats * len(live) * w.users * w.turns
    with NetNamespace() as ns, ns.entered(), tqdm(total=total, desc="requests") as bar:
        for r in range(args.repeats):
            for arm in live[r % len(live):] + live[:r % len(live)]:  # rotate the order
                if arm.status == "ok":
                    bar.set_postfix_str(f"{arm.name} (repeat {r + 1})")
                    run_arm(arm, ns, model, w, env, logs, bar, args.profile_calls)
    arms: dict[str, dict[str, Any]] = {a: {"status": "not run"} for a in ARMS}
    arms |= {a.name: a.result() for a in live}
    res = {"benchmark": "connectors", "quick": args.quick, "model": f"bench ({DTYPE})",
           "worker_threads": f"cores - {reserved} reserved", "workload": asdict(w),
           "repeats": args.repeats, "arms": arms, "summary": summarise(arms, w.users)}
    print_table(res)
    res["meta"] = results_writer.meta(results_writer.command_line(__file__))
    out = args.out or RESULTS / f"connectors{'_quick' if args.quick else ''}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    if any(r["status"] == "ok" for r in arms.values()):
        plot(res, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
