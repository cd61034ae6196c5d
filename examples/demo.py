"""kvcentric demo: a multi-turn conversation over two vLLM instances, with and without reuse.

    make demo        (or: .venv/bin/python examples/demo.py [--turns N])

Starts the embedded local KV store, two vLLM CPU instances with the kvcentric connector
and, for comparison, two plain vLLM instances (prefix caching on). A client holds one
conversation: a long system prompt, then turns that each resend the whole history plus
the previous answers, sent round-robin across the two instances, as a load balancer
without session affinity would. Without kvcentric every turn lands on an instance that
has not seen the previous turn and recomputes the history; with kvcentric the instance
loads it from the store. Prints TTFT per turn and the gain.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvcentric.config import StoreConfig  # noqa: E402
from kvcentric.store import open_store  # noqa: E402
from kvcentric.store.local import launcher  # noqa: E402
from kvcentric.store.metrics import log_line  # noqa: E402
from kvcentric.testing.models import build_model  # noqa: E402
from kvcentric.testing.servers import VllmServer, connector_config  # noqa: E402


def conversation(servers: list[VllmServer], turns: int, system: list[int],
                 seed: int, out_len: int) -> list[tuple[int, float, list[int]]]:
    """Run one conversation; returns (prompt tokens, TTFT s, answer) per turn."""
    rnd = random.Random(seed)
    history = list(system)
    rows = []
    for t in range(turns):
        history += [rnd.randrange(4, 8000) for _ in range(200)]  # the user's new message
        ttft, answer = servers[t % len(servers)].stream(history, max_tokens=out_len)
        rows.append((len(history), ttft, answer))
        history += answer
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description="kvcentric multi-turn demo")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=1536)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()
    t_start = time.monotonic()
    print("building the local bench model (random weights, no download) ...", flush=True)
    model = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    store = {"name": f"demo-{uuid.uuid4().hex[:6]}", "capacity": "1gb"}
    logs = Path(".demo-logs")
    logs.mkdir(exist_ok=True)
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}  # same worker threads for every instance
    # float32: greedy tokens then match exactly between the arms. In bf16, KV an instance
    # computed while decoding differs by rounding from the same KV recomputed in prefill,
    # and the tiny random model's argmax flips on such near-ties (vLLM's own prefix cache
    # behaves the same way).
    common = {"model": model, "name": "bench", "dtype": "float32", "max_model_len": 8192,
              "env": env}
    kvc = [VllmServer(**common, kv_transfer=connector_config(store),  # type: ignore[arg-type]
                      log_path=logs / f"kvc{i}.log") for i in range(2)]
    plain = [VllmServer(**common, log_path=logs / f"plain{i}.log")  # type: ignore[arg-type]
             for i in range(2)]
    print("starting the store and 4 vLLM CPU instances (about a minute) ...", flush=True)
    try:
        for s in kvc + plain:
            s.start()
        for s in kvc + plain:
            s.wait_ready(600)
        warm = [random.Random(7).randrange(4, 8000) for _ in range(256)]
        for s in kvc + plain:
            s.complete(warm, max_tokens=2, timeout_s=600)
        system = [random.Random(1).randrange(4, 8000) for _ in range(args.system_len)]
        print(f"running a {args.turns}-turn conversation, round-robin over 2 instances ...",
              flush=True)
        base = conversation(plain, args.turns, system, 2, args.output_len)
        ours = conversation(kvc, args.turns, system, 2, args.output_len)
        with open_store(store) as st:
            stats = st.stats()
    finally:
        for s in kvc + plain:
            s.stop()
        launcher.stop(StoreConfig.from_dict(store))
    report(base, ours, stats, time.monotonic() - t_start)


def report(base: list, ours: list, stats: dict, elapsed: float) -> None:  # type: ignore[type-arg]
    print(f"\n{'turn':>4} {'prompt':>7} {'vLLM only':>11} {'kvcentric':>11} {'speed-up':>9}")
    for t, ((n, tb, ab), (_, tk, ak)) in enumerate(zip(base, ours), 1):
        same = "" if ab == ak else "  (tokens differ!)"
        print(f"{t:>4} {n:>7} {1e3 * tb:>9.0f}ms {1e3 * tk:>9.0f}ms {tb / tk:>8.1f}x{same}")
    later_b = sum(r[1] for r in base[1:])
    later_k = sum(r[1] for r in ours[1:])
    print(f"\nturns 2..{len(base)}: mean TTFT {1e3 * later_b / (len(base) - 1):.0f} ms "
          f"(vLLM prefix cache only) vs {1e3 * later_k / (len(ours) - 1):.0f} ms (kvcentric): "
          f"{later_b / later_k:.1f}x faster")
    print(f"identical tokens in every turn: {all(b[2] == k[2] for b, k in zip(base, ours))}")
    print(log_line(stats))
    print(f"demo finished in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
