"""The fused cache write replayed from CUDA graphs: one graph launch per step.

Launching the fused write through Triton's Python launcher and copying its
table to the device is a few dozen Python and driver calls, and on the engine's
host, its CPU caches cold from the step before, that took ~0.6 ms of a request's
critical path (``benchmarks/host_path.py``). Here both are captured once in a
CUDA graph: the table's copy from a pinned staging buffer into a device buffer
of fixed capacity, then the kernel over that capacity
(:func:`fused_write.write_counted`: programs past the number of tokens in use,
which the table carries, do nothing). A step writes its table into the staging
buffer (one NumPy copy into a view kept with the graph) and replays the graph on the forward stream (an in-place
read of host memory: on the side stream, below).

An in-place read of pinned host memory (``Config.tuning.pinned_reads = "overlap"``) is
split into groups of layers, each layer's attention waiting for its group only.
Replayed from a graph (``Config.tuning.pinned_read_graphs``), the groups' launches are
captured one after another, each followed by an event that the graph itself
records (an *external* event: the forward stream, outside the graph, can wait
for it), so that one graph launch replaces a Triton launch, an event and its
record per group.

Graphs per capacity (powers of two) and way of launching (the groups, the
programs per layer), captured when a step first needs one, so that few programs
run idle, and captured again when the rotary table they read has grown (the old
graphs are kept until their last replay has run). A graph's staging buffer may be
written again only once the GPU has run its last replay, and a step's write can
still be queued when the next step comes: a background load's write waits on its
stream for the forward pass of the step that issued it, which the engine's host,
a step ahead under asynchronous scheduling, has only just launched. So each
capacity keeps up to :data:`REPLICAS` graphs, each with its own buffers, and a
step replays the first one the GPU is done with. Where no graph can serve a step
(more tokens than the largest capacity, every replica still queued), the caller
launches the kernel as usual; a capture that fails turns graphs off for good,
with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inferscale.inject import fused_write
from inferscale.inject.sources import ROWS, Sources

logger = logging.getLogger(__name__)

#: capacities of the graphs, in tokens: 64, 128, ..., 16384
CAPACITIES = tuple(64 << i for i in range(9))
#: graphs kept per capacity and way of launching, each with its own staging buffer: the one a step
#: replays may still be queued at the next step, and (behind the forward pass) at the one after
REPLICAS = 3


@dataclass
class _Graph:
    staging: torch.Tensor  # pinned host, ROWS * capacity + 1 int64
    rows: np.ndarray  # the staging buffer's rows of a Sources table (a NumPy view of it)
    count: np.ndarray  # its last element: the number of tokens in use
    table: torch.Tensor  # the same on the device
    graph: torch.cuda.CUDAGraph
    done: torch.cuda.Event  # recorded after each replay: once it has run, the staging buffer may be written again
    rotary: tuple[torch.Tensor, torch.Tensor]  # the cos/sin table the kernel reads
    groups: list[tuple[range, torch.cuda.Event]]  # each group of layers, the event after its writes (the last: done)


class WriteGraphs:
    """Fused writes of every layer of ``cache``, replayed from CUDA graphs (see the module)."""

    def __init__(self, cache: fused_write.CacheViews, head0: int, rotary_dim: int, neox: bool,
                 capacities: tuple[int, ...] = CAPACITIES):
        self.cache, self.head0, self.rotary_dim, self.neox = cache, head0, rotary_dim, neox
        self.capacities = capacities
        self.device = cache.bases.device
        self._graphs: dict[tuple, list[_Graph]] = {}  # (capacity, stored dtype and heads, groups, programs)
        self._retired: list[_Graph] = []  # graphs of an older rotary table, kept until their last replay has run
        self._rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # the cos/sin the graphs read
        self.enabled = self.device.type == "cuda" and fused_write.available()

    def write(self, sources: Sources, cos: torch.Tensor, sin: torch.Tensor,
              groups: Sequence[range] | None = None, programs: int | None = None
              ) -> list[tuple[range, torch.cuda.Event]] | None:
        """Queue the write of ``sources`` (its table on the host) on the current stream: one launch
        over every layer, or one per group of ``groups`` (contiguous ranges of layers, in order)
        with at most ``programs`` programs per layer (:func:`fused_write.write_tokens`). Returns
        each group of layers (every layer, without ``groups``) with the event its writes are done
        at, the last recorded after the whole replay; None when no graph can serve the write
        (nothing queued: launch the kernel instead). The events are the graph's own, recorded
        again by its next replay."""
        count = sources.num_tokens
        capacity = next((c for c in self.capacities if c >= count), None)
        if not self.enabled or capacity is None or count == 0:
            return None
        if self._rotary is None or self._rotary[0] is not cos or self._rotary[1] is not sin:
            self._retire()  # the rotary table was made (or grown): these graphs read the old one
            self._rotary = (cos, sin)
        elif self._retired:
            self._retired = [graph for graph in self._retired if not graph.done.query()]
        key = (capacity, (sources.dtype, sources.num_heads), None if groups is None else tuple(groups), programs)
        graph = self._idle(key)
        if graph is None:
            return None
        graph.rows[:, :count] = sources.table.numpy()
        graph.count[0] = count
        graph.graph.replay()
        graph.done.record()
        return graph.groups

    def _idle(self, key: tuple) -> _Graph | None:
        """A graph of ``key`` whose last replay has run (its staging buffer may be written): one
        kept, else one captured now while fewer than :data:`REPLICAS` are kept; None if none."""
        replicas = self._graphs.setdefault(key, [])
        for graph in replicas:
            if graph.done.query():
                return graph
        return self._capture(key) if len(replicas) < REPLICAS else None

    def _retire(self) -> None:
        """Drop the graphs; one the GPU may still be replaying (an earlier step, with
        asynchronous scheduling) is kept, with the rotary table it reads, until it has run."""
        self._retired += [graph for replicas in self._graphs.values() for graph in replicas if not graph.done.query()]
        self._graphs.clear()

    def _capture(self, key: tuple) -> _Graph | None:
        try:
            graph = self._make(*key)
        except Exception as exc:  # the kernel is launched instead, every step
            self.enabled = False
            logger.warning("inferscale: CUDA graphs of the fused write are off (%s: %s)", type(exc).__name__, exc)
            return None
        self._graphs[key].append(graph)
        return graph

    def _make(self, capacity: int, stored: tuple[torch.dtype, int], groups: tuple[range, ...] | None,
              programs: int | None) -> _Graph:
        cos, sin = self._rotary
        dtype, stored_heads = stored
        staging = torch.zeros(ROWS * capacity + 1, dtype=torch.int64, pin_memory=True)
        table = torch.zeros(ROWS * capacity + 1, dtype=torch.int64, device=self.device)
        # recorded by the graph itself (external), except after the last group: `done` is, by the replay's caller
        marks = [torch.cuda.Event(external=True) for _ in groups[:-1]] if groups else []

        def work():
            table.copy_(staging, non_blocking=True)
            for index, layers in enumerate(groups or [None]):
                fused_write.write_counted(self.cache, table, capacity, dtype, cos, sin, self.head0,
                                          self.rotary_dim, self.neox, layers, programs, stored_heads)
                if index < len(marks):
                    marks[index].record()

        forward = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(forward)
        with torch.cuda.stream(side):
            work()  # compiles the kernel where needed, outside the capture (a count of 0: writes nothing)
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                work()
            finally:
                graph.capture_end()
        forward.wait_stream(side)
        done = torch.cuda.Event()
        done.record(forward)
        spans = list(groups) if groups else [range(self.cache.num_layers)]
        view = staging.numpy()
        rows, count = view[:ROWS * capacity].reshape(ROWS, capacity), view[ROWS * capacity:]
        return _Graph(staging, rows, count, table, graph, done, self._rotary, list(zip(spans, [*marks, done])))
