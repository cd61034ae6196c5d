"""The router with memory probes inside it, for :mod:`benchmarks.reliability.soak_router`.

    python -m benchmarks.reliability.router_probe CONFIG OUTDIR [--trace]

Runs ``kvcentric.router.cli serve`` as usual (the app is built before any probe starts,
so start-up is not counted) and answers two signals:

- ``SIGUSR2`` (cheap, every sample): appends one JSON line to ``OUTDIR/probes.jsonl``:
  the router's bookkeeping sizes (:func:`sizes`), CPython's small-object allocator
  (pymalloc: arenas mapped, bytes in live blocks) and glibc malloc (``mallinfo2``: heap
  obtained, in use, free inside it, mmapped), so RSS growth can be split into Python
  objects, allocator slack and native allocations;
- ``SIGUSR1`` (a snapshot, twice per soak): ``snapN.tracemalloc`` (with ``--trace``:
  tracemalloc runs from the first request on), ``snapN.types.json`` (live GC-tracked
  objects by type) and ``snapN.sizes.json``, then ``snapN.done``.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kvcentric.router.ops.memory import glibc_malloc

TRACE_FRAMES = 12


def pymalloc() -> dict[str, float]:
    """CPython's small-object allocator (MiB): arenas mapped and bytes in live blocks
    (``sys._debugmallocstats``, which writes to the C stderr: captured through a file)."""
    with tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")

    def num(pattern: str) -> float:
        m = re.search(pattern + r"\s*=\s*([\d,]+)", text)
        return int(m.group(1).replace(",", "")) / 2**20 if m else float("nan")

    return {"pymalloc_arenas_mib": round(num(r"\d+ arenas \* \d+ bytes/arena"), 2),
            "pymalloc_used_mib": round(num(r"# bytes in allocated blocks"), 2)}


def sizes(state: Any) -> dict[str, int]:
    """Entries in the router's own bookkeeping: what could grow with requests."""
    c = state.conductor
    out = {"index_blocks": len(c.index._owners), "heat_keys": len(c.heat._heat),
           "tasks": len(asyncio.all_tasks()), "inflight_budgets": len(state.inflight.counts),
           "queued_prefills": sum(i.queued for i in c.registry),
           "peer_prefills": len(c._peer_prefills), "gc_objects": len(gc.get_objects())}
    if c.store is not None:
        out |= {"store_present": len(c.store._present), "store_absent": len(c.store._absent),
                "store_disk": len(c.store._disk)}
    if state.tokenizer.prefix is not None:
        out["prompt_cache_chars"] = state.tokenizer.prefix._chars
    if state.replicator is not None:
        out["hot_prefixes"] = len(state.replicator.prefixes)
        out["warmed"] = len(state.replicator._warmed)
    return out


def main(argv: list[str]) -> int:
    import signal
    import tracemalloc

    import uvicorn

    from kvcentric.router.api.app import build_app
    from kvcentric.router.config import load_config

    config, outdir, trace = argv[0], Path(argv[1]), "--trace" in argv[2:]
    cfg = load_config(config)
    app = build_app(cfg)
    state = app.state.router
    counter = itertools.count()

    def probe(sig: int, frame: Any) -> None:
        row = {"t": time.monotonic(), **sizes(state), **pymalloc(), **glibc_malloc(),
               "threads": len(os.listdir("/proc/self/task"))}
        with open(outdir / "probes.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")

    def snapshot(sig: int, frame: Any) -> None:
        base = outdir / f"snap{next(counter)}"
        gc.collect()
        if tracemalloc.is_tracing():
            tracemalloc.take_snapshot().dump(f"{base}.tracemalloc")
        types = Counter(type(o).__qualname__ for o in gc.get_objects())
        Path(f"{base}.types.json").write_text(json.dumps(dict(types.most_common(300))))
        Path(f"{base}.sizes.json").write_text(json.dumps(sizes(state)))
        Path(f"{base}.done").touch()

    signal.signal(signal.SIGUSR1, snapshot)
    signal.signal(signal.SIGUSR2, probe)
    if trace:
        tracemalloc.start(TRACE_FRAMES)
    uvicorn.run(app, host=cfg.listen.host, port=cfg.listen.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
