"""Order the worker's copies against the forward pass with CUDA streams and events.

One dedicated *copy stream* per worker carries every pack and unpack; the *compute
stream* is whatever stream is current when vLLM calls the connector's layer hooks.

Saves (after layer ``l``'s attention wrote its pages)::

    compute: ... attn(l) --record e_l-->   attn(l+1) ...
    copy:                  wait e_l -> pack(l) -> ... -> record s   (commit waits for s)

Loads (before layer ``l``'s attention reads its pages)::

    copy:    unpack(0) -> record l_0 -> unpack(1) -> record l_1 ...
    compute: wait l_0 -> attn(0) -> wait l_1 -> attn(1) ...

No host synchronisation on the hot path: the host waits only where host memory is
involved -- before a read lease is released (its bytes are being DMA'd) and before saved
objects are committed (their bytes must be complete). After the saves the compute stream
waits for ``s``, so no later kernel can overwrite a page before its pack has read it.

CUDA graphs: the layer hooks run in vLLM's attention ops, which piecewise CUDA graphs
leave outside the captured graphs, so the events are recorded and waited eagerly; a full
graph would capture them once and is not supported with the connector (enforce eager or
piecewise). ``torch.cuda.stream`` is per thread, so the copy thread's unpacks go to the
copy stream while the compute thread's current stream is untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class CopyOrdering:
    """A copy stream on ``device`` and the events that order it (see module docstring).

    Load calls for one step: :meth:`begin_loads`, :meth:`run_load` per layer (any
    thread), :meth:`wait_layer` per layer (compute thread, after ``run_load`` returned
    for that layer), :meth:`loads_done` before releasing leases. Save calls:
    :meth:`run_save` per layer (compute thread), :meth:`saves_enqueued` once at the end
    of the step; the returned event is what a commit waits for.
    """

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CopyOrdering needs a CUDA device, got {device}")
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._loaded: list[torch.cuda.Event | None] = []

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def begin_loads(self, num_layers: int) -> None:
        """Start a step's loads (compute thread): the unpacks run after everything the
        compute stream has enqueued so far, which may still read pages that vLLM freed
        and now hands to the loading requests."""
        self._loaded = [None] * num_layers
        before = torch.cuda.Event()
        before.record(self._compute())
        self.stream.wait_event(before)

    def run_load(self, layer: int, enqueue: Callable[[], None]) -> None:
        """Enqueue layer ``layer``'s unpack (``enqueue``) on the copy stream and record
        its event. Runs on the copy thread once the layer's bytes are in host memory."""
        with torch.cuda.stream(self.stream):
            enqueue()
            event = torch.cuda.Event()
            event.record(self.stream)
        self._loaded[layer] = event

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
        """Enqueue a layer's pack (``enqueue``) on the copy stream after everything the
        compute stream has enqueued so far (that layer's attention included)."""
        written = torch.cuda.Event()
        written.record(self._compute())
        self.stream.wait_event(written)
        with torch.cuda.stream(self.stream):
            enqueue()

    def saves_enqueued(self) -> torch.cuda.Event:
        """Event after every pack enqueued so far; later compute waits for it too."""
        packed = torch.cuda.Event()
        packed.record(self.stream)
        self._compute().wait_event(packed)
        return packed
