"""An emulated engine fleet and a kvcentric router in front of it, for router tests that
need real router processes and engines that answer in milliseconds (no vLLM).

:data:`FAST` is the engine profile (every step a few milliseconds); :func:`fleet` starts
``n`` emulated engines of the ``bench`` model for a module; :func:`router` makes (not
starts) a router :class:`~benchmarks.serving.gateways.Gateway` over them that reads their
KV events (and, with ``replay``, their replay endpoints) and never refuses."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.emulator.launch import EmulatedFleet, EmulatorSpec
from benchmarks.emulator.profile import EngineProfile
from benchmarks.serving.gateways import Gateway, kvcentric_router
from kvcentric.testing.models import build_model

FAST = EngineProfile("fast", "test", api_s=0.001, step_s=0.004, prefill_token_s=2e-5,
                     prefill_pair_s=1e-9, decode_seq_s=1e-4, decode_ctx_s=0.0)


@contextmanager
def fleet(logs: Path, n: int, **kw: Any) -> Iterator[EmulatedFleet]:
    """``n`` emulated ``bench`` engines with the :data:`FAST` profile, logging to ``logs``;
    ``kw`` goes to :class:`~benchmarks.emulator.launch.EmulatorSpec` (e.g. ``kind``)."""
    prof = logs / "fast.json"
    FAST.save(prof)
    tok = str(build_model("bench", Path.cwd() / ".models" / "bench"))
    with EmulatedFleet(EmulatorSpec(n, tok, profile=str(prof), pages=256,
                                    max_model_len=8192, **kw), logs) as f:
        yield f


def router(f: EmulatedFleet, logs: Path, tag: str, replay: bool = False,
           **kw: Any) -> Gateway:
    """A router over ``f`` (see the module docstring); ``kw`` goes to
    :func:`~benchmarks.serving.gateways.kvcentric_router` (e.g. ``policy``, ``extra``)."""
    keys = ("url", "name", "kv_events", "kind", "role") + (
        ("kv_events_replay",) if replay else ())
    insts = [{k: s[k] for k in keys if k in s} for s in f.specs]
    return kvcentric_router(model="bench", tokenizer=str(Path.cwd() / ".models" / "bench"),
                            worker_urls=f.urls, store=None, slo_ttft_ms=10_000,
                            slo_tpot_ms=1_000, logs=logs, reject=False, instances=insts,
                            tag=tag, **kw)
