"""One step's transfer state on the worker: what a step loads (:class:`LoadStep`) and saves
(:class:`SaveStep`), each a fresh object per step.

Why objects, not worker fields reset at the step's end: a copy job that overran its step
(a hung store, a bound that ran out) still runs after the worker moved on. A job holds
*its* step's object, so it can only ever see its own plans, its own gate and its own
leases, never the next step's; and the worker starts each step from an empty object
instead of clearing a dozen fields one by one (a field forgotten there leaks into the
next step).

Ownership: the worker's thread creates and mutates a step object until the step ends
(``KVCentricWorker.finish_step``); afterwards only the step's own jobs and their
done-callbacks (:func:`when_done`) read it. The leases and slots listed here are the
store's; a step object hands them back (release, commit or abort) exactly once, from the
worker's thread or from the callback that runs after the step's last job.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kvcentric.connector.vllm.mover import PagePlan
from kvcentric.connector.vllm.transfers import TransferSpec
from kvcentric.integrity import ObjectRef
from kvcentric.store import ReadLease, WriteSlot

log = logging.getLogger("kvcentric.connector")


class Gate:
    """Whether one step's load jobs may still write the KV cache. Closing waits for an
    unpack in progress (a copy, never a store call); after :meth:`close` no job of that
    step unpacks (a late one may still be in a store call: its step's leases are released
    only once it is done)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = True

    def close(self) -> None:
        with self.lock:
            self.open = False


@dataclass(frozen=True)
class LoadPlan:
    """One request's load in a step: its lease, the plan moving the lease's objects into
    the request's pages, and the objects the headers must name."""

    req_id: str
    lease: ReadLease
    plan: PagePlan
    refs: list[ObjectRef]


@dataclass
class LoadStep:
    """A step's loads: filled by ``start_load``, waited on by the layer hooks, ended by
    ``finish_step``.

    ``plans``: one per request with something to load (in lease order). ``leases``: every
    lease taken this step, including those none of whose objects are used (all are
    released). ``futs[l]``: layer ``l``'s copy job. ``group``: layers per ranged fetch.
    ``wait_left``: seconds the step may still wait for its jobs (one budget for the
    layer waits and ``finish_step``). ``failed``: the step gave up its loads (every page
    reported for recompute; waits return at once). ``background``: an asynchronous step
    (its requests compute in a later step, once ``deadline``, ``time.monotonic()``, has
    not passed before its jobs are done); ``req_ids``: the requests it loads for."""

    plans: list[LoadPlan] = field(default_factory=list)
    leases: list[ReadLease] = field(default_factory=list)
    futs: list[Future[None]] = field(default_factory=list)
    gate: Gate = field(default_factory=Gate)
    group: int = 1
    wait_left: float = 0.0
    failed: bool = False
    background: bool = False
    deadline: float = 0.0
    req_ids: set[str] = field(default_factory=set)


@dataclass
class SaveStep:
    """A step's saves: taken by ``plan_saves``, reserved at the first layer hook (or at
    ``finish_step`` after a full CUDA graph), packed layer by layer, committed or aborted
    by ``finish_step``.

    ``specs``: the saves not yet reserved (emptied by the reservation). ``state_saves``:
    recurrent-state saves (hybrid models), done after the forward. ``slots`` and ``plan``:
    the reserved objects and the plan packing pages into them (None: nothing reserved).
    ``futs``: the pack jobs. ``packed``: layers whose pack is queued, from layer 0 (all of
    them, or the objects are incomplete and aborted). ``batch``: CUDA layers waiting for
    their group of ``group`` layers (one transfer per group)."""

    specs: list[TransferSpec] = field(default_factory=list)
    state_saves: list[TransferSpec] = field(default_factory=list)
    commit_now: bool = False
    slots: list[WriteSlot] = field(default_factory=list)
    plan: PagePlan | None = None
    futs: list[Future[None]] = field(default_factory=list)
    packed: int = 0
    batch: list[torch.Tensor] = field(default_factory=list)
    group: int = 1


def when_done(futs: Sequence[Future[None]], fn: Callable[[], None]) -> None:
    """Run ``fn`` once every future in ``futs`` is done (now, when they all are; else on
    the thread that finishes the last one). Cancelled futures count as done."""
    left = [len(futs) + 1]
    lock = threading.Lock()

    def one(_: object = None) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            try:
                fn()
            except Exception:  # a callback must not die silently on the copy thread
                log.exception("deferred cleanup failed")

    for fut in futs:
        fut.add_done_callback(one)
    one()
