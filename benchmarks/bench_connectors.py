"""Multi-turn serving through vLLM: no connector vs vLLM's MooncakeStoreConnector vs ours,
the last two on the same Mooncake Store, in one run.

    python benchmarks/bench_connectors.py [--quick] [--out FILE.json]

One vLLM CPU server per arm (``bench`` model, float32, the same pinned worker threads and
the same small KV cache in every arm), all up at once, serves the same conversations;
each request goes to the arms one after the other (the first arm rotating), so every arm
sees the same machine at the same time and only one computes at any moment:

- ``no_connector``: vLLM with prefix caching only;
- ``mooncake_store_connector``: vLLM's built-in ``MooncakeStoreConnector`` (config via
  ``MOONCAKE_CONFIG_PATH``, ``standalone-store`` mode: the engine is a pure client and a
  storage node holds the memory);
- ``kvcentric``: our connector with the ``mooncake`` backend, also a pure client of the
  same master and node (the two connectors' keys never collide).

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

Everything Mooncake runs in a private network namespace (its listeners bind all
interfaces); the vLLM servers run inside it too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvcentric.store.mooncake_netns import NetNamespace  # noqa: E402
from kvcentric.store.mooncake_service import master_command, wait_master  # noqa: E402
from kvcentric.testing.models import build_model  # noqa: E402
from kvcentric.testing.servers import VllmServer, connector_config  # noqa: E402

RESULTS = Path(__file__).parent / "results"
ARMS = ("no_connector", "mooncake_store_connector", "kvcentric")
MASTER = "127.0.0.1:50051"
PAGE = 128  # vLLM CPU block size; both connectors store 128-token blocks
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


def counters(server: VllmServer) -> dict[str, float]:
    """Hit counters, plus every connector counter (ours: ``vllm:kvcentric_*``) for the
    profile of where a hit's time goes."""
    m = server.metrics()
    out = {"engine_hit_tokens": m.get("vllm:prefix_cache_hits_total", 0.0),
           "external_hit_tokens": m.get("vllm:external_prefix_cache_hits_total", 0.0),
           "prompt_tokens": m.get("vllm:prompt_tokens_total", 0.0)}
    for name, value in m.items():
        if "{" not in name and ("kvcentric" in name or "mooncake" in name.lower()):
            out[name] = value
    return out


@dataclass
class Arm:
    """One arm: its server and its copy of the conversations."""

    name: str
    server: VllmServer
    status: str = "ok"
    busy_s: float = 0.0

    def __post_init__(self) -> None:
        self.history: list[list[int]] = []
        self.ttfts: list[float] = []
        self.outputs: list[list[int]] = []
        self.before: dict[str, float] = {}

    def fail(self, exc: BaseException) -> None:
        log = self.server.log_path
        self.status = f"failed: {type(exc).__name__}: {exc}"
        self.log_tail = log.read_text(errors="replace")[-1500:] if log else ""
        self.server.stop()

    def result(self) -> dict[str, Any]:
        if self.status != "ok":
            return {"status": self.status, "log_tail": self.log_tail}
        after = counters(self.server)
        delta = {k: after[k] - self.before.get(k, 0.0) for k in after}
        t = self.ttfts
        p90 = statistics.quantiles(t, n=10)[-1] if len(t) > 1 else t[0]
        return {"status": "ok", "ttft_ms": [1e3 * x for x in t],
                "ttft_mean_ms": 1e3 * statistics.mean(t), "ttft_p90_ms": 1e3 * p90,
                "ttft_median_ms": 1e3 * statistics.median(t),
                "requests_per_s": len(t) / self.busy_s,
                "output_tokens_per_s": sum(len(o) for o in self.outputs) / self.busy_s,
                "hit_tokens": delta["engine_hit_tokens"] + delta["external_hit_tokens"],
                **{k: delta.pop(k) for k in ("engine_hit_tokens", "external_hit_tokens",
                                             "prompt_tokens")},
                "connector_counters": delta, "outputs": self.outputs}


def serve(arms: list[Arm], w: Workload, bar: tqdm) -> None:
    """The conversations, round-robin over users; each request goes to every arm in turn
    (the first arm rotating), so all arms see the same machine noise at the same time."""
    system, docs, msgs = w.prompts()
    warm = random.Random(1).sample(range(4, 8000), 256)
    for arm in arms:
        arm.history = [system + d for d in docs]
        arm.server.complete(warm, max_tokens=2)  # first requests pay one-off costs
        arm.before = counters(arm.server)
    k = 0
    for turn in range(w.turns):
        for u in range(w.users):
            live = [a for a in arms if a.status == "ok"]
            for arm in live[k % len(live):] + live[:k % len(live)] if live else []:
                prompt = arm.history[u] + msgs[u][turn]
                t0 = time.perf_counter()
                try:
                    ttft, toks = arm.server.stream(prompt, max_tokens=w.answer_len,
                                                   timeout_s=900)
                except Exception as exc:  # an arm that breaks is reported, never faked
                    arm.fail(exc)
                    continue
                arm.busy_s += time.perf_counter() - t0
                arm.ttfts.append(ttft)
                arm.outputs.append(toks)
                arm.history[u] = prompt + toks
            k += 1
            bar.update()


def mooncake_json(path: Path) -> Path:
    """vLLM's MooncakeStoreConnector config: a pure client of our master, node holds memory."""
    path.write_text(json.dumps({
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
        "master_server_address": MASTER, "protocol": "tcp", "device_name": "",
        "global_segment_size": 0, "local_buffer_size": "512mb", "mode": "standalone-store"}))
    return path


def make_server(arm: str, model: str, w: Workload, env: dict[str, str], logs: Path
                ) -> VllmServer:
    args = ("--num-gpu-blocks-override", str(w.engine_blocks), "--block-size", str(PAGE))
    common: dict[str, Any] = {"model": model, "name": "bench", "dtype": DTYPE,
                              "max_model_len": w.max_len, "args": args,
                              "log_path": logs / f"connectors-{arm}.log"}
    if arm == "no_connector":
        return VllmServer(**common, env=env)
    if arm == "mooncake_store_connector":
        cfg = mooncake_json(logs / "connectors-mooncake.json")
        return VllmServer(**common, env=env | {"MOONCAKE_CONFIG_PATH": str(cfg)},
                          kv_transfer={"kv_connector": "MooncakeStoreConnector",
                                       "kv_role": "kv_both", "kv_connector_extra_config": {}})
    store = {"backend": "mooncake", "mooncake": {
        "master_server_address": MASTER, "metadata_server": "P2PHANDSHAKE", "use_env": False,
        "global_segment_size": 0, "staging_size": "512mb"}}
    return VllmServer(**common, env=env,
                      kv_transfer=connector_config(store, block_size=PAGE, save_decode=False))


def start_arms(names: list[str], model: str, w: Workload, env: dict[str, str],
               logs: Path) -> list[Arm]:
    arms = [Arm(n, make_server(n, model, w, env, logs)) for n in names]
    for arm in arms:
        arm.server.start()
    for arm in arms:
        try:
            arm.server.wait_ready(900)
        except Exception as exc:  # e.g. a connector that cannot run here: say why
            arm.fail(exc)
    return arms


class Cluster:
    """mooncake_master and one storage node, in the namespace this thread is in."""

    def __init__(self, ns: NetNamespace, logs: Path, segment: str) -> None:
        log = open(logs / "connectors-master.log", "ab")
        self.procs: list[subprocess.Popen[Any]] = [subprocess.Popen(
            ns.wrap(master_command(metadata_port=0)), stdout=log, stderr=log,
            start_new_session=True)]
        wait_master("127.0.0.1", 50051, 9003, proc=self.procs[0])
        node = subprocess.Popen(
            ns.wrap([sys.executable, "-m", "kvcentric.store.mooncake_service", "mooncake-node",
                     "--segment", segment, "--master", MASTER, "--metadata", "P2PHANDSHAKE"]),
            stdout=subprocess.PIPE, stderr=open(logs / "connectors-node.log", "ab"), text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
            start_new_session=True)
        self.procs.append(node)
        assert node.stdout is not None
        if "ready" not in node.stdout.readline():
            self.stop()
            raise RuntimeError("the storage node did not start; see connectors-node.log")

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)


def summarise(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ok = {a: r for a, r in arms.items() if r["status"] == "ok"}
    ref = ok.get("no_connector", {}).get("outputs")
    out: dict[str, Any] = {
        "status": {a: r["status"] for a, r in arms.items()},
        "ttft_mean_ms": {a: r["ttft_mean_ms"] for a, r in ok.items()},
        "ttft_p90_ms": {a: r["ttft_p90_ms"] for a, r in ok.items()},
        "ttft_median_ms": {a: r["ttft_median_ms"] for a, r in ok.items()},
        "hit_tokens": {a: r["hit_tokens"] for a, r in ok.items()},
        "external_hit_tokens": {a: r["external_hit_tokens"] for a, r in ok.items()},
        "engine_hit_tokens": {a: r["engine_hit_tokens"] for a, r in ok.items()},
        "requests_per_s": {a: r["requests_per_s"] for a, r in ok.items()},
        "outputs_match_no_connector": {a: r["outputs"] == ref for a, r in ok.items()
                                       if ref is not None},
    }
    if "kvcentric" in ok and "mooncake_store_connector" in ok:
        out["outputs_match_between_connectors"] = \
            ok["kvcentric"]["outputs"] == ok["mooncake_store_connector"]["outputs"]
    mean = out["ttft_mean_ms"]
    for a in ("mooncake_store_connector", "kvcentric"):
        if a in mean and "no_connector" in mean:
            out[f"ttft_{a}_vs_no_connector"] = mean[a] / mean["no_connector"]
    if "kvcentric" in mean and "mooncake_store_connector" in mean:
        out["ttft_kvcentric_vs_mooncake_store_connector"] = \
            mean["kvcentric"] / mean["mooncake_store_connector"]
        med = out["ttft_median_ms"]
        out["ttft_median_kvcentric_vs_mooncake_store_connector"] = \
            med["kvcentric"] / med["mooncake_store_connector"]
        # each request ran on both back to back: the median of per-request ratios is the
        # comparison least moved by load spikes on a shared machine
        pairs = zip(ok["kvcentric"]["ttft_ms"], ok["mooncake_store_connector"]["ttft_ms"])
        out["ttft_paired_median_kvcentric_vs_mooncake_store_connector"] = \
            statistics.median(a / b for a, b in pairs)
    return out


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [a for a in ARMS if res["arms"][a]["status"] == "ok"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(ok))
    a1.bar([x - 0.2 for x in xs], [res["summary"]["ttft_mean_ms"][a] for a in ok], 0.4,
           label="mean")
    a1.bar([x + 0.2 for x in xs], [res["summary"]["ttft_p90_ms"][a] for a in ok], 0.4,
           label="p90")
    a1.set_xticks(list(xs), ok, fontsize=8)
    a1.set(ylabel="TTFT (ms)", title="TTFT per arm")
    a1.legend()
    for a in ok:
        a2.plot(res["arms"][a]["ttft_ms"], marker="o", label=a)
    a2.set(xlabel="request (turn-major, round-robin over users)", ylabel="TTFT (ms)",
           title="TTFT per request")
    a2.legend(fontsize=8)
    wl = res["workload"]
    fig.suptitle(f"vLLM CPU, bench model: {wl['users']} users x {wl['turns']} turns, "
                 f"engine cache {wl['engine_blocks']} blocks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(res: dict[str, Any]) -> None:
    s = res["summary"]
    print(f"\n{'arm':>26} {'TTFT mean':>10} {'p90':>8} {'median':>8} {'req/s':>7} "
          f"{'engine hit':>11} {'store hit':>10} {'same tokens':>12}")
    for a in ARMS:
        r = res["arms"][a]
        if r["status"] != "ok":
            print(f"{a:>26} {r['status']}")
            continue
        print(f"{a:>26} {r['ttft_mean_ms']:10.0f} {r['ttft_p90_ms']:8.0f} "
              f"{r['ttft_median_ms']:8.0f} {r['requests_per_s']:7.3f} "
              f"{r['engine_hit_tokens']:11.0f} "
              f"{r['external_hit_tokens']:10.0f} "
              f"{str(s['outputs_match_no_connector'].get(a, '-')):>12}")
    for k, v in s.items():
        if k.startswith("ttft_") and "_vs_" in k and isinstance(v, float):
            print(f"{k}: {v:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset")
    ap.add_argument("--summarise", type=Path, help="recompute summary, table and PNG of a "
                    "result JSON (no servers run)")
    args = ap.parse_args()
    if args.summarise:
        res = json.loads(args.summarise.read_text())
        res["summary"] = summarise(res["arms"])
        args.summarise.write_text(json.dumps(res, indent=1) + "\n")
        print_table(res)
        plot(res, args.summarise.with_suffix(".png"))
        return
    w = QUICK if args.quick else FULL
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("connectors-*"):
        old.unlink()  # servers append to their logs: start this run's clean
    model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    reserved = "1" if (os.cpu_count() or 1) <= 2 else "0"
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": reserved, "VLLM_HOST_IP": "127.0.0.1"}
    chosen = [a for a in ARMS if a in args.arms.split(",")]
    arms: dict[str, dict[str, Any]] = {a: {"status": "not run"} for a in ARMS}
    with NetNamespace() as ns, ns.entered():
        cluster = Cluster(ns, logs, "2gb")
        live: list[Arm] = []
        try:
            live = start_arms(chosen, model, w, env, logs)
            with tqdm(total=w.users * w.turns, desc="requests (all arms)") as bar:
                serve(live, w, bar)
            arms |= {a.name: a.result() for a in live}
        finally:
            for a in live:
                a.server.stop()
            cluster.stop()
    res = {"benchmark": "connectors", "quick": args.quick, "model": f"bench ({DTYPE})",
           "worker_threads": f"cores - {reserved} reserved", "workload": asdict(w),
           "arms": arms, "summary": summarise(arms)}
    print_table(res)
    out = args.out or RESULTS / f"connectors{'_quick' if args.quick else ''}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    if any(r["status"] == "ok" for r in arms.values()):
        plot(res, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
