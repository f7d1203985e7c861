"""Worker side, vLLM-free: memory loads that overlap the forward pass, layer by layer.

On a GPU, the connector issues a step's loads (gather, RoPE, cache writes) on
a side CUDA stream and records one event per layer once that layer's cache
writes are queued. The forward pass waits for a layer's event right before
that layer's attention (vLLM calls ``wait_for_layer_load``), so the loads of
later layers run while earlier layers compute, and no host thread ever waits
for the GPU. When the forward pass will not ask per layer (a full CUDA graph
replay, a step without attention metadata), the forward stream waits for all
layers at once before it starts. The fused write (one kernel for every layer)
is queued on the forward stream itself: the forward would wait for all of it
before layer 0 anyway, and a side stream only cost host time; stream order then
makes the forward's kernels follow it with no wait at all (on the step's path
every host call counts: the forward pass is paced by the host). Copies of host
memory to the GPU that the fused write then reads (a pinned store's facts, not
read in place) run on a copy stream of their own that waits for nothing, so
that the bus is busy while the GPU still works on earlier steps.

On a CPU there are no streams: loads run in order, before the forward pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class LayerLoads:
    def __init__(self, device: torch.device, num_layers: int):
        self.device = device
        self.num_layers = num_layers
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        #: where copies from host memory run (:meth:`copying`): they wait for nothing
        self.copies = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.events = [torch.cuda.Event() for _ in range(num_layers)] if self.stream else []
        self._pending: dict[int, torch.cuda.Event] = {}
        self._waited: set[int] = set()  # ids of events the forward stream already waits for
        self._kept: list[tuple[torch.cuda.Event, list]] = []  # tensors in use by queued work
        self._on_side = False  # whether the work being issued goes to the side stream

    @contextlib.contextmanager
    def issuing(self, side_stream: bool = True) -> Iterator[None]:
        """Queue the work inside on the side stream, after everything already queued on the
        forward stream (the blocks being written may have been read by earlier steps); with
        ``side_stream=False`` on the forward stream itself (one kernel that the forward would
        wait for at once anyway: no stream switch, no cross-stream wait)."""
        if self.stream is None:
            yield
            return
        self.wait_all()
        self._waited.clear()
        if self._kept:
            self._kept = [(event, refs) for event, refs in self._kept if not event.query()]
        if not side_stream:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._on_side = True
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            self._on_side = False

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """Queue the copies inside, from host memory into GPU buffers of their own, on the copy
        stream, which waits for no other: nothing earlier on the GPU touches those buffers, so the
        copy engines move them while the forward stream still runs the steps before (vLLM
        schedules a step ahead of the GPU) instead of after them. The current stream waits for
        them when the block ends, before the writes that read them."""
        if self.copies is None:
            yield
            return
        try:
            with torch.cuda.stream(self.copies):
                yield
        finally:
            torch.cuda.current_stream(self.device).wait_stream(self.copies)

    def layer_queued(self, index: int) -> None:
        """Layer ``index``'s cache writes are queued (call inside :meth:`issuing`)."""
        if self.stream is not None:
            self.events[index].record(self.stream)
            self._pending[index] = self.events[index]

    def all_queued(self, keep: list, done: torch.cuda.Event | None = None) -> None:
        """Every layer's writes are queued, by one kernel on the current stream (call inside
        :meth:`issuing`); ``keep`` stays referenced until that work has run (the tensors it
        reads, pinned host memory among them). ``done``: an event the caller recorded right
        after that work (else one is recorded here). From the side stream the forward pass
        waits once, before layer 0; on the forward stream itself nothing is pending: its
        kernels run after the writes in stream order."""
        if self.stream is None:
            return
        if done is None:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        if self._on_side:
            self._pending[0] = done  # (it comes after any group queued there: it covers them)
        self._kept.append((done, keep))

    def group_queued(self, layers: range, keep: list | None = None, event: torch.cuda.Event | None = None
                     ) -> None:
        """The writes of ``layers`` are queued, by one kernel on the side stream (call inside
        :meth:`issuing`); each of those layers' attention waits for them alone. ``keep`` stays
        referenced until that work has run. ``event``: one already recorded right after those
        writes (by a CUDA graph's replay), else one is recorded here."""
        if self.stream is None:
            return
        if event is None:
            event = torch.cuda.Event()
            event.record(self.stream)
        for index in layers:
            self._pending[index] = event
        if keep:
            self._kept.append((event, keep))

    def wait_layer(self, index: int) -> None:
        """Make the forward stream wait for layer ``index``'s writes (no host wait)."""
        event = self._pending.pop(index, None)
        if event is not None and id(event) not in self._waited:
            torch.cuda.current_stream(self.device).wait_event(event)
            self._waited.add(id(event))

    def wait_all(self) -> None:
        """Make the forward stream wait for every layer still pending."""
        for index in sorted(self._pending):
            self.wait_layer(index)

    def is_pending(self, index: int) -> bool:
        """Whether layer ``index`` has writes the forward stream does not wait for yet."""
        return index in self._pending


def layer_groups(num_layers: int, launches: int) -> list[range]:
    """``num_layers`` layers in at most ``launches`` contiguous groups of near-equal size, in order."""
    launches = max(1, min(launches, num_layers))
    bounds = [round(i * num_layers / launches) for i in range(launches + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]
