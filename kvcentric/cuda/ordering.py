"""Order the worker's copies against the forward pass with CUDA streams and events.

Two *copy lanes* (streams) per worker carry every pack and unpack, layers alternating
between them, so that one layer's gather/scatter in HBM overlaps the previous layer's
DMA across PCIe (one stream would run them back to back); the *compute stream* is
whatever stream is current when vLLM calls the connector's layer hooks.

Saves (after layer ``l``'s attention wrote its pages)::

    compute: ... attn(l) --record e_l-->   attn(l+1) --record e_l+1--> ...
    lane l%2:              wait e_l -> pack(l)
    lane (l+1)%2:                     wait e_l+1 -> pack(l+1)   ... -> record s (both lanes)

Loads (before layer ``l``'s attention reads its pages)::

    lane 0:  unpack(0) -> record l_0      unpack(2) -> record l_2 ...
    lane 1:        unpack(1) -> record l_1 ...
    compute: wait l_0 -> attn(0) -> wait l_1 -> attn(1) ...

No host synchronisation on the hot path: the host waits only where host memory is
involved -- before a read lease is released (its bytes are being DMA'd) and before saved
objects are committed (their bytes must be complete). After the saves the compute stream
waits for ``s``, so no later kernel can overwrite a page before its pack has read it.
Scratch memory a lane allocates is reused only on that lane (the caching allocator is
stream-ordered), so it outlives its copies.

CUDA graphs: the layer hooks run in vLLM's attention ops, which piecewise CUDA graphs
leave outside the captured graphs, so the events are recorded and waited eagerly; a full
graph would capture them once and is not supported with the connector (enforce eager or
piecewise). ``torch.cuda.stream`` is per thread, so the copy thread's unpacks go to the
copy lanes while the compute thread's current stream is untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class CopyOrdering:
    """The copy lanes on ``device`` and the events that order them (module docstring).

    Load calls for one step: :meth:`begin_loads`, :meth:`run_load` per layer (any
    thread), :meth:`wait_layer` per layer (compute thread, after ``run_load`` returned
    for that layer), :meth:`loads_done` before releasing leases. Save calls:
    :meth:`run_save` per layer (compute thread), :meth:`saves_enqueued` once at the end
    of the step; the returned event is what a commit waits for. Asynchronous loads (their
    requests compute in a later step): :meth:`after_compute` (compute thread), then
    :meth:`load_now` per transfer (load thread).
    """

    LANES = 2

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CopyOrdering needs a CUDA device, got {device}")
        self.device = device
        self.lanes = [torch.cuda.Stream(device) for _ in range(self.LANES)]
        # asynchronous loads: a stream of their own, so that no save's event (which the
        # compute stream waits for) is ever recorded behind a load spanning steps
        self.background = torch.cuda.Stream(device)
        self._loaded: list[torch.cuda.Event | None] = []
        self._saves = 0  # packs enqueued this step (picks the lane)
        self._loads = 0  # unpacks enqueued this step (picks the lane)

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def after_compute(self) -> None:
        """Every lane waits for what the compute stream has enqueued so far (compute
        thread): before an asynchronous load into pages vLLM freed, which kernels still
        queued may read."""
        event = torch.cuda.Event()
        event.record(self._compute())
        for lane in (*self.lanes, self.background):
            lane.wait_event(event)

    def begin_loads(self, num_layers: int) -> None:
        """Start a step's loads (compute thread): the unpacks run after everything the
        compute stream has enqueued so far, which may still read pages that vLLM freed
        and now hands to the loading requests."""
        self._loaded = [None] * num_layers
        self._loads = 0
        self.after_compute()

    def run_load(self, layer: int, enqueue: Callable[[], None], count: int = 1) -> None:
        """Enqueue the unpack (``enqueue``) of layers ``layer .. layer + count - 1`` on a
        lane and record the event every one of them waits for. Runs on the copy thread
        once the layers' bytes are in host memory."""
        lane = self.lanes[self._loads % self.LANES]  # calls alternate lanes, as saves
        self._loads += 1
        with torch.cuda.stream(lane):
            enqueue()
            event = torch.cuda.Event()
            event.record(lane)
        for i in range(layer, layer + count):
            self._loaded[i] = event

    def load_now(self, enqueue: Callable[[], None]) -> None:
        """Enqueue an unpack (``enqueue``) on the background stream and wait (host) until
        it has run: an asynchronous load, on its load thread, after :meth:`after_compute`;
        the compute stream never waits for it (its request computes in a later step,
        after this returned)."""
        with torch.cuda.stream(self.background):
            enqueue()
            event = torch.cuda.Event()
            event.record(self.background)
        event.synchronize()

    def wait_layer(self, layer: int) -> None:
        """Make the compute stream wait for layer ``layer``'s unpack (no host wait)."""
        event = self._loaded[layer] if layer < len(self._loaded) else None
        if event is not None:
            self._compute().wait_event(event)

    def loads_done(self) -> None:
        """Host wait until every unpack enqueued this step has run (their source
        bytes belong to read leases about to be released)."""
        for event in self._loaded:
            if event is not None:
                event.synchronize()
        self._loaded = []

    def run_save(self, enqueue: Callable[[], None]) -> None:
        """Enqueue a layer's pack (``enqueue``) on the next lane, after everything the
        compute stream has enqueued so far (that layer's attention included)."""
        lane = self.lanes[self._saves % self.LANES]
        self._saves += 1
        written = torch.cuda.Event()
        written.record(self._compute())
        lane.wait_event(written)
        with torch.cuda.stream(lane):
            enqueue()

    def saves_enqueued(self) -> torch.cuda.Event:
        """Event after every pack enqueued so far (on every lane); later compute waits
        for it too."""
        self._saves = 0
        first = self.lanes[0]
        for lane in self.lanes[1:]:
            done = torch.cuda.Event()
            done.record(lane)
            first.wait_event(done)
        packed = torch.cuda.Event()
        packed.record(first)
        self._compute().wait_event(packed)
        return packed
