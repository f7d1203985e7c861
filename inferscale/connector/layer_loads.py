"""Worker side, vLLM-free: memory loads that overlap the forward pass, layer by layer.

On a GPU, the connector issues a step's loads (gather, RoPE, cache writes) on
a side CUDA stream and records one event per layer once that layer's cache
writes are queued. The forward pass waits for a layer's event right before
that layer's attention (vLLM calls ``wait_for_layer_load``), so the loads of
later layers run while earlier layers compute, and no host thread ever waits
for the GPU. When the forward pass will not ask per layer (a full CUDA graph
replay, a step without attention metadata), the forward stream waits for all
layers at once before it starts.

On a CPU there are no streams: loads run in order, before the forward pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class LayerLoads:
    def __init__(self, device: torch.device, num_layers: int):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.events = [torch.cuda.Event() for _ in range(num_layers)] if self.stream else []
        self._pending: set[int] = set()

    @contextlib.contextmanager
    def issuing(self) -> Iterator[None]:
        """Queue the work inside on the side stream, after everything already
        queued on the forward stream (the blocks being written may have been
        read by earlier steps)."""
        if self.stream is None:
            yield
            return
        self.wait_all()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def layer_queued(self, index: int) -> None:
        """Layer ``index``'s cache writes are queued (call inside :meth:`issuing`)."""
        if self.stream is not None:
            self.events[index].record(self.stream)
            self._pending.add(index)

    def wait_layer(self, index: int) -> None:
        """Make the forward stream wait for layer ``index``'s writes (no host wait)."""
        if index in self._pending:
            torch.cuda.current_stream(self.device).wait_event(self.events[index])
            self._pending.discard(index)

    def wait_all(self) -> None:
        """Make the forward stream wait for every layer still pending."""
        for index in sorted(self._pending):
            self.wait_layer(index)

    @property
    def pending(self) -> frozenset[int]:
        return frozenset(self._pending)
