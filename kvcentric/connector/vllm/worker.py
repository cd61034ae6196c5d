"""Worker side of the vLLM connector: layer-wise loads and saves around the forward pass.

Runs in each vLLM worker process. Objects are keyed in this worker's own key space (its
TP rank's), and every object carries an integrity header (:mod:`kvcentric.integrity`):
written with the slot, checked before any byte of the object is unpacked. Per step
(vLLM's call order):

1. ``start_load(meta)`` leases every object to load (one store call per request; the local
   store hands out pointers into shared memory, no copy; a streamed lease, e.g. Mooncake's
   get session, moves no bytes yet) and queues, per layer in layer order on the copy
   thread, the fetch of that layer's byte range and its unpack, so loading runs ahead of
   compute and the forward waits for one layer's transfer, not the whole prefix's. The
   first fetch brings the headers too, and layer 0's unpack starts only once every
   header matched (else the step's loads are recomputed, counted ``integrity_errors``).
2. ``wait_for_layer(l)`` before layer ``l``'s attention: waits for that layer's load.
3. ``save_layer(l, kv)`` after layer ``l``'s attention: on the first layer, reserves
   in-place write slots for all objects completed in this step (one store call) and
   writes their headers; then queues the pack of layer ``l``'s pages into them,
   overlapping the next layers.
4. ``finish_step()`` at the step's end: waits for the copies, reports the pages of any
   lease that lapsed meanwhile (bytes possibly torn) as load errors, releases the read
   leases, and hands the written objects to the :class:`~kvcentric.connector.vllm.commits.
   Committer` (visible all at once, never torn; on the commit thread unless a request
   saving in this step may finish with it).

A step whose forward replays a *full* CUDA graph runs no layer hooks: ``start_load(meta,
hooks_run=False)`` completes every layer's load before returning, and ``finish_step``
saves every layer from the cache after the forward (docs/connector.md §CUDA graphs). On a
CUDA worker (:mod:`kvcentric.connector.vllm.device_path`) the copies run on copy streams
ordered by events; the host waits for them only before releasing leases and committing.

Failures never produce wrong tokens: an object that is missing, corrupt (checksums on),
or whose copy failed is reported through :meth:`take_load_errors` with every page after
it, so vLLM recomputes those tokens; a save that fails is dropped (aborted).

Bounded waits: a step waits for its copy jobs at most ``load_timeout_s`` plus their bytes
at the store's ``min_transfer_rate`` in all (the store bounds each of its own calls). A
step that gives up reports its loads as load errors and aborts its saves, but never frees
what a late job may still use: its jobs stop touching the KV cache (a
:class:`~kvcentric.connector.vllm.steps.Gate`), its leases are released and its slots
aborted only once its jobs are done (a done-callback). Each step's state is an object of
its own (:mod:`kvcentric.connector.vllm.steps`), so a late job only ever sees its step's.

Asynchronous loads (``layout.async_loads``: a P/D decode instance, or asked for; always
for hybrid models): ``start_load`` only leases and queues a step's loads, on a load thread
of their own (saves never queue behind them; on CUDA each copy is waited for on that
thread, never on the compute stream), and returns. The requests compute nothing until
their load is done: each step's :meth:`take_transfer_results` (vLLM's ``get_finished``)
reports the requests whose step of loads completed, or overran its bound (then failed,
as a late synchronous load), after the lapsed-lease check; their failed pages go out in
the same step's :meth:`take_load_errors`, which vLLM reads after ``get_finished``.

Hybrid models (:mod:`kvcentric.connector.vllm.groups`): each layer moves its own group's
pages; recurrent states are objects of their own (:mod:`kvcentric.connector.vllm.states`),
loaded before and saved after the forward. Their loads are asynchronous and a failure is
reported per request (:meth:`take_transfer_results`), never as block ids: vLLM cannot
map those back to a request when there are several groups.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvcentric.connector.vllm.affinity import pin_to, spare_cpus
from kvcentric.connector.vllm.commits import Committer
from kvcentric.connector.vllm.counters import Counters
from kvcentric.connector.vllm.device_path import DevicePath
from kvcentric.connector.vllm.engine_layout import EngineLayout
from kvcentric.connector.vllm.mover import SKIP, PageKernel, PagePlan
from kvcentric.connector.vllm.settings import ConnectorSettings
from kvcentric.connector.vllm.states import StateObjects
from kvcentric.connector.vllm.steps import LoadPlan, LoadStep, SaveStep, when_done
from kvcentric.connector.vllm.transfers import StepPlan, TransferSpec
from kvcentric.integrity import describe
from kvcentric.store import KVStore, ReadLease, StoreUnavailable

log = logging.getLogger("kvcentric.connector")


class IntegrityError(RuntimeError):
    """A leased object's header names another key, rank, layout or format."""


class KVCentricWorker:
    """Moves pages between the paged KV cache and the store for one worker."""

    def __init__(self, settings: ConnectorSettings, layout: EngineLayout, store: KVStore,
                 layer_names: list[str], pin_s: float = 0.0) -> None:
        """``pin_s``: soft-pin what this worker saves (a P/D prefill's handoff)."""
        self.settings = settings
        self._pin_s = pin_s
        self.layout = layout
        self.store = store
        self._headers = layout.headers()
        self.stats = Counters()
        self._layer_index = {name: i for i, name in enumerate(layer_names)}
        groups = layout.groups
        self._layer_groups = groups.layer_group if groups is not None else None
        self._states = StateObjects(layout, store, self.stats) \
            if layout.state_geometry is not None else None
        self._recving: set[str] = set()  # async loads done, until taken
        self._failed: set[str] = set()  # requests whose async load failed (hybrids)
        self._inflight: list[LoadStep] = []  # async loads under way, oldest first
        self._kv: list[torch.Tensor] = []
        spare = spare_cpus() if settings.spare_cpu_threads else None  # affinity.py
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvc-copy", initializer=pin_to,
                                        initargs=(spare,)) if settings.async_copy else None
        # asynchronous loads get a thread of their own: a step's saves never wait behind
        # a load that spans steps (without async_copy they run within start_load)
        self._load_pool = ThreadPoolExecutor(
            1, thread_name_prefix="kvc-load", initializer=pin_to, initargs=(spare,)) \
            if settings.async_copy and layout.async_loads else None
        self._ld = LoadStep()  # this step's loads (a fresh object per step)
        self._sv = SaveStep()  # this step's saves (a fresh object per step)
        self._load_errors: set[int] = set()  # pages to recompute, until taken
        self._committer = Committer(store, self.stats, pin_s, settings.async_commit, spare)
        self._path = DevicePath(PageKernel())
        self._asleep: list[torch.Tensor] | None = None  # the caches while vLLM sleeps

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Learn the per-layer cache tensors, find their block dim (ValueError when no
        dim gives the layout's page size) and set up the device path."""
        missing = set(self._layer_index) - set(kv_caches)
        if missing:
            raise ValueError(f"no KV cache registered for layers {sorted(missing)[:3]}")
        self._kv = [kv_caches[name] for name in self._layer_index]
        if self._states is not None:
            self._states.register(kv_caches)  # type: ignore[arg-type]
        self.store.warm_up()  # before serving: the first request must not pay for it
        self._path = DevicePath.open(self._kv[0], self.layout.geometry.page_bytes, self.store,
                                     self.settings.copy_impl, self.settings.pin_host_memory)

    def layer_of(self, layer_name: str) -> int | None:
        """Index of ``layer_name`` in the stored object; None for a layer we do not store
        (e.g. one sharing another layer's KV)."""
        return self._layer_index.get(layer_name)

    def _run(self, fn: Any, *args: Any, pool: ThreadPoolExecutor | None = None
             ) -> Future[None]:
        """Run ``fn`` on ``pool`` (default: the copy thread), or now without one; failures
        land in the future either way (a failed fetch must become a recompute, never an
        exception in vLLM)."""
        pool = pool or self._pool
        if pool is not None:
            return pool.submit(fn, *args)
        return self._now(fn, *args)

    @staticmethod
    def _now(fn: Any, *args: Any) -> Future[None]:
        """Run ``fn`` on this thread; its outcome lands in the returned future."""
        fut: Future[None] = Future()
        try:
            fn(*args)
            fut.set_result(None)
        except Exception as exc:
            fut.set_exception(exc)
        return fut

    def _timed(self, stat: str, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)``, add its duration to ``stat`` and return its result."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.stats.add(**{stat: time.perf_counter() - t0})

    # ---- loads ----
    def start_load(self, meta: StepPlan, hooks_run: bool = True) -> None:
        """Lease and queue this step's loads. ``hooks_run=False``: the forward replays a
        full CUDA graph, so no ``wait_for_layer`` will come: every layer is loaded (and,
        on CUDA, ordered before the compute stream's next work) before this returns."""
        if not hooks_run:
            self.stats.add(graph_steps=1)
        background = self.layout.async_loads
        ld = LoadStep(background=True) if background else self._ld
        ld.req_ids = {spec.req_id for spec in (*meta.loads, *meta.state_loads)}
        if self._asleep is not None:  # cannot happen in vLLM's order; never touch the cache
            for spec in (*meta.loads, *meta.state_loads):
                self._fail(spec.req_id, spec.page_ids)
            if background:
                self._recving |= ld.req_ids
            return
        if meta.state_loads and self._states is not None:
            self._failed |= self._states.load(meta.state_loads)
        if background and ld.req_ids:
            self._inflight.append(ld)  # reported done by take_transfer_results
        for spec in meta.loads:
            self._timed("fetch_seconds", self._lease_and_plan, ld, spec)
        if ld.plans:
            g = self.layout.geometry
            per_layer = g.pages_per_object * g.page_bytes * sum(
                lp.plan.num_objects for lp in ld.plans)
            # one ranged store call per group of layers: each call has a fixed cost
            # (Mooncake over TCP: ~5 ms), which small per-layer ranges would pay L times
            ld.group = max(1, -(-self.settings.min_fetch_bytes // per_layer))
            ld.wait_left = self._bound_s(per_layer * len(self._kv))
            ld.deadline = time.monotonic() + ld.wait_left
            ordering = self._path.ordering
            if ordering is not None:
                if background:  # the copies follow what compute enqueued on freed pages
                    ordering.after_compute()
                else:
                    ordering.begin_loads(len(self._kv))
            pool = self._load_pool if background else None
            # each job gets its step's object: a late job never sees the next step's
            ld.futs = [self._run(self._timed, "load_seconds", self._unpack_layer, layer, ld,
                                 pool=pool)
                       for layer in range(len(self._kv))]
            if background:
                return
            if not hooks_run:
                for layer in range(len(self._kv)):
                    self._wait_layer(layer)

    def _lease_and_plan(self, ld: LoadStep, spec: TransferSpec) -> None:
        size = self.layout.geometry.object_bytes
        keys = [ref.key(self.layout.keyspace) for ref in spec.refs]
        # a checksum covers the whole object: verified leases must be eager
        acquire = (self.store.batch_acquire if self.settings.store.verify_checksums
                   else self.store.batch_acquire_streamed)
        try:
            lease = acquire(keys, [size] * len(keys))
        except StoreUnavailable as exc:
            log.warning("store unavailable, recomputing %d blocks: %s", len(keys), exc)
            self._fail(spec.req_id, spec.page_ids)
            return
        ld.leases.append(lease)
        good = self._verified_prefix(lease)
        good = next((i for i in range(good) if lease.sizes[i] != size), good)
        if good < len(keys):
            log.info("request %s: %d of %d stored blocks unavailable, recomputing them",
                     spec.req_id, len(keys) - good, len(keys))
            self._fail(spec.req_id, spec.page_ids[good:])
        if good:
            plan = PagePlan(self.layout.geometry, lease.ptrs[:good], spec.page_ids[:good],
                            self._path.kernel, self._layer_groups)
            ld.plans.append(LoadPlan(spec.req_id, lease, plan, spec.refs[:good]))
            self.stats.add(loaded_blocks=good, loaded_bytes=good * size)

    def _verified_prefix(self, lease: ReadLease) -> int:
        if not self.settings.store.verify_checksums:
            return len(lease.keys)
        for i in range(len(lease.keys)):
            if not lease.verified(i):
                log.warning("checksum mismatch for %s: recomputing", lease.keys[i])
                return i
        return len(lease.keys)

    def _fail(self, req_id: str, page_ids: list[list[int]], objects: int | None = None) -> None:
        """Report a failed load of ``objects`` objects (default: one per page list): its
        pages (vLLM recomputes them), or for a hybrid model its request (vLLM recomputes
        it)."""
        if self.layout.failures_by_request:
            self._failed.add(req_id)
        else:
            self._load_errors.update(p for pages in page_ids for p in pages if p != SKIP)
        self.stats.add(load_errors=len(page_ids) if objects is None else objects)

    def _bound_s(self, nbytes: int) -> float:
        """How long a step may wait for copy jobs moving ``nbytes``."""
        return self.settings.load_timeout_s + nbytes / self.settings.store.min_transfer_rate

    def _unpack_layer(self, layer: int, ld: LoadStep) -> None:
        """Copy thread: fetch this layer's group of byte ranges (first layer of a group;
        the first group brings the headers, checked before anything is unpacked), then
        move the layer's pages into the cache: on CPU layer by layer; on CUDA the whole
        group at its first layer, as one transfer per run (small layers, e.g. MLA's, were
        host-bound one DMA, stream switch and event per layer). Nothing is unpacked once
        the step's gate closed (its loads are recomputed: leave the pages alone)."""
        gate = ld.gate
        if not gate.open:
            return
        g = self.layout.geometry
        first = layer % ld.group == 0
        count = min(ld.group, len(self._kv) - layer)
        if first:
            offset, size = g.layer_range(layer, count)
            for lp in ld.plans:
                self.store.fetch_range(lp.lease, offset, size)
        with gate.lock:
            if not gate.open:
                return
            if layer == 0:
                self._check_headers(ld)
            ordering = self._path.ordering
            if ordering is None:
                for lp in ld.plans:
                    lp.plan.unpack_layer(layer, self._kv[layer])
            elif first and ld.background:  # done when the copy is: no compute waits on it
                ordering.load_now(lambda: self._unpack_group(ld, layer, count))
            elif first:  # the bytes are in host memory: the GPU copies them on a copy lane
                ordering.run_load(layer, lambda: self._unpack_group(ld, layer, count), count)

    def _check_headers(self, ld: LoadStep) -> None:
        """Every leased object's header against the object this step asked for;
        ``IntegrityError`` (the step's loads are recomputed; its gate closes, the caller
        holds its lock) on any mismatch."""
        bad = 0
        for lp in ld.plans:
            for ptr, ref, key in zip(lp.lease.ptrs, lp.refs, lp.lease.keys):
                if not self._headers.check(ptr, ref):
                    bad += 1
                    log.error("integrity: object %s was written for %s, this load expects "
                              "%s; recomputing", key, self._headers.describe(ptr),
                              describe(self._headers.expected(ref)))
        if bad:
            ld.gate.open = False
            self.stats.add(integrity_errors=bad)
            raise IntegrityError(f"{bad} leased objects failed their header check")

    def _unpack_group(self, ld: LoadStep, first: int, count: int) -> None:
        for lp in ld.plans:
            lp.plan.unpack_layers(first, self._kv[first:first + count])

    def wait_for_layer(self, layer_name: str) -> None:
        layer = self.layer_of(layer_name)
        if layer is not None:
            self._wait_layer(layer)

    def _wait_layer(self, layer: int) -> None:
        ld = self._ld
        if not ld.futs or ld.failed:
            return
        t0 = time.perf_counter()
        if self._wait_job(ld, ld.futs[layer]) and self._path.ordering is not None:
            self._path.ordering.wait_layer(layer)
        self.stats.add(load_wait_seconds=time.perf_counter() - t0)

    def _fail_loads(self, ld: LoadStep) -> None:
        """Report every page step ``ld`` loads; its jobs must not unpack any more (they
        would write pages vLLM is about to recompute): the gate closes (waiting out an
        unpack in progress) and queued jobs are cancelled."""
        ld.failed = True
        ld.gate.close()
        for fut in ld.futs:
            fut.cancel()
        for lp in ld.plans:
            self._fail(lp.req_id, [lp.plan.page_ids()], lp.plan.num_objects)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """The requests whose asynchronous loads are done since the last call (failed or
        not: their failed pages are in :meth:`take_load_errors` from now on), and those of
        them that failed as requests (hybrid models; empty otherwise). Called once per
        step (vLLM's ``get_finished``), before :meth:`take_load_errors`."""
        self._poll_loads()
        done = self._recving
        failed = self._failed & done
        self._recving, self._failed = set(), self._failed - done
        if failed:
            self.stats.add(failed_requests=len(failed))
        return done, failed

    def _poll_loads(self, wait: bool = False) -> None:
        """End every asynchronous step of loads whose jobs are done, or whose bound ran
        out (its loads fail, as a late synchronous step's); ``wait``: wait for each
        within its bound first (draining). Oldest first: a step's jobs queue behind the
        steps before it on the load thread."""
        left = []
        for ld in self._inflight:
            if wait and ld.futs and not ld.failed:
                ld.wait_left = ld.deadline - time.monotonic()
                for fut in ld.futs:
                    if not self._wait_job(ld, fut):
                        break
            if not ld.failed and not all(f.done() for f in ld.futs):
                if time.monotonic() <= ld.deadline:
                    left.append(ld)
                    continue
                log.error("an asynchronous load overran its bound; recomputing its blocks")
                self._fail_loads(ld)
            elif not ld.failed and (err := next(
                    (e for f in ld.futs if (e := f.exception()) is not None), None)):
                log.error("an asynchronous load failed (%s); recomputing its blocks", err)
                self._fail_loads(ld)
            self._end_loads(ld)
            self._recving |= ld.req_ids
        self._inflight = left

    # ---- saves ----
    def plan_saves(self, meta: StepPlan) -> None:
        """Take this step's saves; a rank that is not its key space's ``writer`` (MLA on
        TP ranks past the first DCP group: another rank stores the same bytes) and a
        sleeping worker save nothing."""
        writes, sv = self.layout.writer and self._asleep is None, self._sv
        sv.specs = list(meta.saves) if writes else []
        sv.state_saves = list(meta.state_saves) if writes and self._states else []
        sv.commit_now = meta.commit_now

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        layer, sv = self.layer_of(layer_name), self._sv
        if layer is None or (sv.plan is None and not sv.specs):
            return
        if sv.plan is None and not self._timed("commit_seconds", self._reserve, sv):
            return
        assert sv.plan is not None
        ordering, plan = self._path.ordering, sv.plan
        if ordering is None:
            sv.futs.append(self._run(self._timed, "save_seconds", plan.pack_layer,
                                     layer, kv_layer))
            sv.packed += 1
            return
        # CUDA: layers in groups of sv.group (one transfer per run, as loads), each
        # group enqueued behind its last layer's attention; no thread, no host wait
        if layer != sv.packed + len(sv.batch):
            sv.futs.append(self._now(self._skipped_layer, layer))  # never commit
            return
        sv.batch.append(kv_layer)
        if len(sv.batch) < sv.group and layer < len(self._kv) - 1:
            return
        start, batch = sv.packed, sv.batch
        sv.batch, sv.packed = [], start + len(batch)
        sv.futs.append(self._now(self._timed, "save_seconds", ordering.run_save,
                                 lambda: plan.pack_layers(start, batch)))

    @staticmethod
    def _skipped_layer(layer: int) -> None:
        raise RuntimeError(f"layer {layer}'s save came out of order: the objects would be "
                           f"incomplete")

    def _reserve(self, sv: SaveStep) -> bool:
        """Reserve write slots for all of step ``sv``'s new blocks (one store call) and
        write their headers."""
        ks = self.layout.keyspace
        refs, pages, parents = [], [], []
        for spec in sv.specs:
            refs += spec.refs
            pages += spec.page_ids
            parents += [p.key(ks) if p is not None else None for p in spec.parents]
        keys = [ref.key(ks) for ref in refs]
        size = self.layout.geometry.object_bytes
        try:
            slots = self.store.batch_alloc(keys, [size] * len(keys), parents)
        except StoreUnavailable as exc:
            log.warning("store unavailable, not saving %d blocks: %s", len(keys), exc)
            slots = [None] * len(keys)
        live = [(s, p, r) for s, p, r in zip(slots, pages, refs) if s is not None]
        self.stats.add(skipped_blocks=len(keys) - len(live))
        sv.specs = []
        if not live:
            return False
        for slot, _, ref in live:
            self._headers.write(slot.ptr, ref)
        sv.slots = [s for s, _, _ in live]
        sv.plan = PagePlan(self.layout.geometry, [s.ptr for s in sv.slots],
                           [p for _, p, _ in live], self._path.kernel, self._layer_groups)
        g = self.layout.geometry
        per_layer = g.pages_per_object * g.page_bytes * len(live)
        sv.group = max(1, -(-self.settings.min_fetch_bytes // per_layer))
        return True

    def finish_step(self) -> None:
        """End of step: save what no layer hook saved (a full CUDA graph ran no hooks; the
        cache now holds every layer), wait for copies, commit saves, release leases. The
        next step starts from fresh step objects."""
        sv = self._sv
        if sv.specs and sv.plan is None:
            for name, layer in self._layer_index.items():
                self.save_layer(name, self._kv[layer])
        ld, self._ld, self._sv = self._ld, LoadStep(), SaveStep()
        self._finish_loads(ld)
        self._finish_saves(sv)
        if sv.state_saves and self._states is not None:  # the forward wrote them by now
            slots = self._states.save(sv.state_saves)
            if slots:
                self._committer.commit(slots, now=sv.commit_now, stat="saved_states")

    def _finish_loads(self, ld: LoadStep) -> None:
        for fut in ld.futs:  # within the step's bound: leases outlive copies
            if ld.failed or not self._wait_job(ld, fut):
                break
        if self._path.ordering is not None:
            self._path.ordering.loads_done()  # the GPU may still read the leased bytes
        self._end_loads(ld)

    def _end_loads(self, ld: LoadStep) -> None:
        """After step ``ld``'s copies (or its failure): report the pages of leases that
        lapsed meanwhile, and release its leases once no job of it runs."""
        for lp in ld.plans:
            if not ld.failed and not self.store.lease_valid(lp.lease):
                # the store reclaimed the lease (its connection dropped) while we copied:
                # the bytes may be torn, so vLLM recomputes these pages and drops this
                # step's tokens for them
                log.warning("a read lease lapsed during the load; recomputing %d blocks",
                            lp.plan.num_objects)
                self._fail(lp.req_id, [lp.plan.page_ids()], lp.plan.num_objects)
        leases, store = ld.leases, self.store

        def release() -> None:
            for lease in leases:
                store.release(lease)
        # a job that overran its step may still fetch into, or read, its leases
        when_done(ld.futs, release)

    def _wait_job(self, ld: LoadStep, fut: Future[None]) -> bool:
        """Wait for one of step ``ld``'s load jobs within what is left of its bound; a
        job that failed or is late fails the step's loads (False)."""
        t0 = time.perf_counter()
        try:
            fut.result(max(ld.wait_left, 0.0))
            return True
        except Exception as exc:  # failed, or late (TimeoutError): recompute all loaded
            log.error("layer load failed (%s); recomputing this step's loaded blocks",
                      exc or type(exc).__name__)
            self._fail_loads(ld)
            return False
        finally:
            ld.wait_left -= time.perf_counter() - t0

    def _finish_saves(self, sv: SaveStep) -> None:
        slots, futs = sv.slots, sv.futs
        if not slots:
            return
        # the packs may wait behind this step's late load jobs on the copy thread
        left = self._bound_s(len(slots) * self.layout.geometry.object_bytes)
        try:
            for fut in futs:
                t0 = time.perf_counter()
                fut.result(max(left, 0.0))
                left -= time.perf_counter() - t0
        except Exception as exc:  # failed, or late (TimeoutError): never commit
            log.error("saving %d blocks failed: %s", len(slots), exc or type(exc).__name__,
                      exc_info=not isinstance(exc, TimeoutError))
            for fut in futs:
                fut.cancel()
            store = self.store  # a pack still running writes into the slots: abort after it
            when_done(futs, lambda: store.batch_abort(slots))
            return
        if sv.packed != len(self._kv):  # a layer never ran: the objects are incomplete
            self.store.batch_abort(slots)
            return
        packed = self._path.ordering.saves_enqueued() if self._path.ordering else None
        self._committer.commit(slots, packed, now=sv.commit_now)

    # ---- sleep mode (vLLM >= 0.33: unregister_kv_caches / restore_kv_caches) ----
    def suspend(self) -> None:
        """Before vLLM's sleep mode remaps the KV cache: finish what is still in flight
        (a step's copies, its leases, every pending commit: their bytes are out of the
        cache already) and stop using the cache tensors; until :meth:`resume`, a step's
        loads are reported for recompute and its saves dropped. Idempotent."""
        if self._asleep is not None:
            return
        self.finish_step()  # vLLM drains transfers first: then this is a no-op
        self._poll_loads(wait=True)
        self._committer.drain()
        self._asleep, self._kv = self._kv, []

    def resume(self) -> None:
        """After vLLM's wake-up: the same cache tensors (vLLM remaps their memory at the
        same addresses; their contents are new) are used again. Idempotent."""
        if self._asleep is not None:
            self._kv, self._asleep = self._asleep, None

    def close(self) -> None:
        self._poll_loads(wait=True)
        for pool in (self._pool, self._load_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._committer.close()  # pending commits land before the store closes
        self._path.close()  # unpins the store's memory before the store unmaps it
        self.store.close()
