"""Connector counters, kept per step by the scheduler and the workers without vLLM
(:mod:`kvcentric.connector.vllm.stats` turns a snapshot into vLLM's stats object)."""

from __future__ import annotations

# name -> help text; every field is a counter summed over steps and workers
FIELDS = {
    "lookups": "Prefix lookups in the store",
    "lookup_seconds": "Time the scheduler spent in store lookups (blocks scheduling)",
    "hit_tokens": "Prompt tokens found in the store (scheduler side)",
    "tail_hits": "Hits that load a tail object (the prompt's partial last block)",
    "saved_tails": "Tail objects planned for saving (prefill end; last token with "
                   "save_decode)",
    "loaded_blocks": "Stored blocks loaded into the engine",
    "loaded_bytes": "Bytes loaded from the store",
    "load_seconds": "Time spent in layer loads: ranged fetches and copies (worker; "
                    "overlaps compute when async)",
    "fetch_seconds": "Time the worker spent leasing stored objects at step start (blocks "
                     "the step; a streamed lease moves its bytes in the layer loads)",
    "load_wait_seconds": "Time the forward pass waited for layer loads (worker)",
    "load_errors": "Stored blocks that failed to load and were recomputed",
    "saved_blocks": "Blocks written to the store",
    "saved_bytes": "Bytes written to the store",
    "save_seconds": "Time spent in save copies (worker; overlaps compute when async)",
    "commit_seconds": "Time the worker spent reserving and committing saves (blocks the "
                      "step)",
    "skipped_blocks": "Blocks not saved: already stored or no space",
    "integrity_errors": "Leased objects whose integrity header named another key, rank, "
                        "layout or format (their step's loads were recomputed)",
    "unkeyed_requests": "Requests whose KV depends on inputs the keys cannot name "
                        "(neither loaded nor saved)",
    "graph_steps": "Steps whose forward replayed a full CUDA graph (no layer hooks: loads "
                   "finished before it, saves ran after it)",
    "loaded_states": "Recurrent states (hybrid models) loaded into the engine",
    "saved_states": "Recurrent states (hybrid models) written to the store",
    "failed_requests": "Asynchronous loads that failed as a whole (any failure of a hybrid "
                       "model's, another model's from its first block): vLLM recomputed "
                       "those requests",
}


class Counters:
    """Sums of :data:`FIELDS` since the last :meth:`take` (one owner thread per field
    group; a lost increment under a race costs a metric, never data)."""

    def __init__(self) -> None:
        self.data: dict[str, float] = dict.fromkeys(FIELDS, 0)

    def add(self, **inc: float) -> None:
        for name, value in inc.items():
            self.data[name] += value

    def take(self) -> dict[str, float] | None:
        """The counts so far, and reset; None when nothing happened."""
        if not any(self.data.values()):
            return None
        snap, self.data = self.data, dict.fromkeys(FIELDS, 0)
        return snap
