"""Worker side, vLLM-free: the write policy of a step's memory into the paged cache.

:class:`KVWriter` decides how each step's loads reach the cache: where the fused write may run
(``Config.tuning.fused_write``, Triton, a sources table that compiles, a cache layout it knows), one
kernel writes every layer for every request (:mod:`~inferscale.inject.fused_write`), replayed
from CUDA graphs with ``Config.tuning.write_graphs``, reading pinned host blocks in place a group of
layers at a time with ``Config.tuning.pinned_reads = "overlap"``; elsewhere each layer's K/V is
gathered and rotated (:meth:`SegmentLoader.load`) and written through the cache's views,
layer by layer, overlapping the forward pass (:mod:`~inferscale.inject.layer_loads`).

The engine's cache is handed in as a :class:`PagedCache` (the adapter's
:class:`~inferscale.inject.cache_layout.PagedLayers`: vLLM's registered caches with the layout the
engine-start self-test confirmed; nothing is written where none was); a load that fails is never raised into the engine: its blocks are reported
(:meth:`KVWriter.take_load_errors`) and vLLM recomputes them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from inferscale.compose.rope import RotaryEmbedding
from inferscale.compose.segment import Segment
from inferscale.config import Config
from inferscale.inject import fused_write
from inferscale.inject import sources as sources_table
from inferscale.inject.layer_loads import LayerLoads, layer_groups
from inferscale.inject.loader import LoadSpec, SegmentLoader
from inferscale.inject.sources import Sources
from inferscale.inject.stats import ConnectorStats
from inferscale.inject.write_graphs import WriteGraphs
from inferscale.storage.tiers import Tiers

#: the connector's logger (under vLLM's, whose handler prints it)
logger = logging.getLogger("vllm.inferscale.connector")


class PagedCache(Protocol):
    """The engine's paged KV cache during one step, layer by layer (index 0 = the first decoder layer)."""

    def views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's K and V views ``[num_blocks, block_size, kv_heads, head_size]`` for the
        fused write; a ValueError says why it cannot address them."""

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """Write K/V ``[tokens, kv_heads, head_size]`` into ``layer``'s cache at ``slots``
        through the layout confirmed for it (:mod:`~inferscale.inject.cache_layout`)."""


def by_stored_kind(ready: list) -> list[list]:
    """``(spec, sources, tier)`` entries grouped by the stored K/V's dtype and head count."""
    groups: dict[tuple, list] = {}
    for entry in ready:
        groups.setdefault((entry[1].dtype, entry[1].num_heads), []).append(entry)
    return list(groups.values())


class KVWriter:
    """Writes each step's loads (:class:`LoadSpec`) for this rank's ``heads`` into the paged cache."""

    #: whether a sources table is staged in pinned memory before its copy (:meth:`Sources.to`): where
    #: the stream it is copied on has work queued ahead of it
    pins_tables = False

    def __init__(self, config: Config, tiers: Tiers, rope: RotaryEmbedding, heads: slice, head_size: int,
                 stats: ConnectorStats, counts: bool = True):
        self.config, self.tiers, self.rope, self.heads, self.head_size = config, tiers, rope, heads, head_size
        #: every rank loads the same users: one (rank 0) counts hits and host time
        self.stats, self.counts = stats, counts
        self.num_layers = 0
        self.loader: SegmentLoader | None = None
        self.layer_loads: LayerLoads | None = None
        self._fused_allowed = False
        self._cache_views: fused_write.CacheViews | bool | None = None  # None: not looked at yet
        self._write_graphs: WriteGraphs | None = None
        self._host_groups: tuple[range, ...] = ()
        self._load_errors: set[int] = set()

    def register(self, num_layers: int, device: torch.device, dtype: torch.dtype) -> None:
        """The engine's caches exist: ``num_layers`` of them, on ``device``, in ``dtype``."""
        config = self.config
        self.num_layers = num_layers
        self.loader = SegmentLoader(self.tiers.memory, self.tiers.record, self.rope, self.heads, device, dtype,
                                    host_in_place=config.tuning.pinned_reads == "overlap",
                                    in_place_from=int(config.tuning.pinned_copy_below_mib * 2**20),
                                    copy_at_most=int(config.tuning.pinned_copy_above_mib * 2**20))
        self.layer_loads = LayerLoads(device, num_layers)
        #: whether the fused write may run here (its sources table's loop compiled now, not on the
        #: first request's path); whether it can, the cache layout decides (:meth:`_fused_views`)
        self._fused_allowed = config.tuning.fused_write and fused_write.available() and sources_table.ready()
        #: the launches of an in-place read of host memory (pinned_reads = "overlap"), a group of layers each
        self._host_groups = tuple(layer_groups(num_layers, config.tuning.pinned_read_launches))

    def write_step(self, loads: Sequence[LoadSpec], cache: PagedCache, waits_per_layer: bool = True) -> None:
        """Queue this step's loads; the forward pass waits for each layer in :meth:`wait_layer`,
        or, unless ``waits_per_layer``, for all of them now."""
        if self.loader is None:
            raise RuntimeError("KV caches were never registered with the connector")
        began = time.perf_counter()
        fused = self._fused_views(cache) is not None
        in_place = fused and self.loader.step_in_place(loads, self.num_layers, self.head_size)
        self._count_step("in_place" if in_place else "copied" if self.loader.copies_from_host(in_place=False) else "resident")
        # one kernel from GPU memory runs before the forward on its own stream; reads of host
        # memory in place (pinned_reads = "overlap") and the per-layer path overlap it from a side stream
        with self.layer_loads.issuing(side_stream=not fused or in_place):
            if fused:
                self._write_fused(loads, in_place)
            else:
                self._write(cache, self._prepare(loads))
        if not waits_per_layer:
            self.layer_loads.wait_all()
        self._host_time("load", time.perf_counter() - began)

    def refuse_step(self, loads: Sequence[LoadSpec]) -> None:
        """Write none of this step's loads (the caches' layout is not understood): their blocks
        are reported (:meth:`take_load_errors`) and vLLM recomputes them."""
        for spec in loads:
            self._load_errors.update(spec.blocks)

    def wait_layer(self, index: int) -> None:
        """Make the forward stream wait for layer ``index``'s writes (no host wait)."""
        if self.layer_loads is not None and self.layer_loads.is_pending(index):
            began = time.perf_counter()
            self.layer_loads.wait_layer(index)
            self._host_time("wait", time.perf_counter() - began)

    def wait_all(self) -> None:
        """Whatever the forward pass did not wait for, later work on its stream does."""
        if self.layer_loads is not None:
            self.layer_loads.wait_all()

    def take_load_errors(self) -> set[int]:
        """The cache blocks whose loads failed since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---------------- the fused write ----------------

    def _fused_views(self, cache: PagedCache) -> fused_write.CacheViews | None:
        """The paged caches as the fused kernel addresses them; None when it is off
        (``Config.tuning.fused_write``) or cannot run (no Triton, a cache on the CPU, K and V views
        of different strides, a dtype it does not know (said once, in the log), no Numba to build its
        sources table): then each layer is written through the cache's views. Looked at once, on the first step."""
        if self._cache_views is None:
            self._cache_views = False
            if self._fused_allowed:
                try:
                    self._cache_views = fused_write.CacheViews.of(cache.views())
                except ValueError as exc:
                    logger.warning("inferscale: the fused cache write is off: %s; each layer is written "
                                   "through its cache's views", exc)
                    return None
                if self.config.tuning.write_graphs and self._cache_views.bases.device.type == "cuda":
                    self._write_graphs = WriteGraphs(self._cache_views, self.heads.start, self.rope.rotary_dim,
                                                     self.rope.style == "neox")
        return self._cache_views or None

    def _write_fused(self, loads: Sequence[LoadSpec], in_place: bool) -> None:
        """One kernel writes every layer for every request of the step, queued on the forward
        stream itself (nothing to synchronise; the forward's wait at layer 0 is then free). From
        host memory, a few launches of a group of layers each, on the side stream: each layer's
        attention waits for its group only. Copies from host memory run first, on the copy stream
        (:meth:`LayerLoads.copying`)."""
        ready: list[tuple[LoadSpec, Sources, str]] = []
        copies = self.layer_loads.copying() if self.loader.copies_from_host(in_place) else contextlib.nullcontext()
        with copies:
            for spec in loads:
                try:
                    tier = self._tier(spec)
                    ready.append((spec, self.loader.sources(spec, self.num_layers, self.head_size, in_place), tier))
                except Exception as exc:  # never crash the engine: report the blocks, vLLM recomputes
                    self._load_failed(spec, exc)
        keep, done = [], None  # done: an event recorded after the last work queued, if one was
        for group in by_stored_kind(ready):  # one group unless facts were stored in two dtypes
            try:
                sources = Sources.join([part for _, part, _ in group])
                cos, sin = self.rope.table(self.loader.device, max(spec.end for spec, _, _ in group))
                sources, done = self._launch_fused(sources, cos, sin)
            except Exception as exc:  # these requests are recomputed
                done = None
                for spec, _, _ in group:
                    self._load_failed(spec, exc)
                continue
            if not sources.in_host_memory:
                keep.append(sources)  # its table and the blocks it points into
            for spec, _, tier in group:
                self._count_hit(spec, tier)
        if keep:
            self.layer_loads.all_queued(keep, done)

    def _launch_fused(self, sources: Sources, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[Sources, torch.cuda.Event | None]:
        """From GPU memory: one replay of a CUDA graph (``Config.tuning.write_graphs``), else one launch,
        on the current stream. From host memory: a launch per group of layers, each group's event
        recorded, all replayed from one graph with ``Config.tuning.pinned_read_graphs``. Returns the
        sources the queued work reads (their table, when it was copied to the device, and the
        blocks), and the event the graph recorded after its replay (else None)."""
        host = sources.in_host_memory
        groups = self._host_groups if host else None
        programs = (self.config.tuning.pinned_read_programs or None) if host else None
        if self._write_graphs is not None and (not host or self.config.tuning.pinned_read_graphs):
            events = self._write_graphs.write(sources, cos, sin, groups, programs)
            if events is not None:  # (the graph reads its own table)
                for layers, event in events if host else ():  # the sources kept until the last group has run
                    self.layer_loads.group_queued(layers, [sources] if layers == groups[-1] else None, event)
                return sources, events[-1][1]
        sources = sources.to(self.loader.device, pinned=self.pins_tables)
        neox = self.rope.style == "neox"
        for layers in groups or [None]:
            fused_write.write_tokens(self._cache_views, sources, cos, sin, self.heads.start,
                                     self.rope.rotary_dim, neox, layers, programs)
            if host:
                self.layer_loads.group_queued(layers, [sources] if layers == groups[-1] else None)
        return sources, None

    # ---------------- the per-layer write ----------------

    def _prepare(self, loads: Sequence[LoadSpec]) -> list[tuple[LoadSpec, Segment, torch.Tensor]]:
        ready = []
        for spec in loads:
            try:
                ready.append((spec, self._segment(spec), self.loader.slot_mapping(spec)))
            except Exception as exc:  # never crash the engine: report the blocks, vLLM recomputes
                self._load_failed(spec, exc)
        return ready

    def _segment(self, spec: LoadSpec) -> Segment:
        """The spec's K/V, rotated, this rank's heads, in the cache dtype."""
        tier = self._tier(spec)
        segment = self.loader.load(spec, self.num_layers, self.head_size)
        self._count_hit(spec, tier)
        return segment

    def _write(self, cache: PagedCache, ready: list[tuple[LoadSpec, Segment, torch.Tensor]]) -> None:
        """Each layer's K/V for every request, then that layer's event."""
        failed: set[str] = set()
        for index in range(self.num_layers):
            for spec, segment, slots in ready:
                if spec.req_id in failed:
                    continue
                try:
                    cache.write(index, segment.keys[index], segment.values[index], slots)
                except Exception as exc:  # the blocks are reported; vLLM recomputes them
                    failed.add(spec.req_id)
                    self._load_failed(spec, exc)
            self.layer_loads.layer_queued(index)

    # ---------------- bookkeeping ----------------

    def _tier(self, spec: LoadSpec) -> str:
        """Where the request's memory is found: the memory tier when it holds the version the request
        was scheduled with, else the store of record behind it (which fills the memory tier first)."""
        memory = self.tiers.memory
        held = memory.epoch(spec.user_id) == spec.epochs[1] if memory.volatile else memory.has_user(spec.user_id)
        return memory.name if held else self.tiers.record.name

    def _count_hit(self, spec: LoadSpec, tier: str) -> None:
        if self.counts:
            self.stats.record_hit(tier, self._bytes_read(spec, tier))

    def _bytes_read(self, spec: LoadSpec, tier: str) -> int:
        """What a load read from ``tier``: the whole user from the store of record (the memory tier
        is filled a user at a time), the tokens it wrote (this rank's heads) from the memory tier."""
        if tier != self.tiers.record.name:
            return (spec.end - spec.start) * self.loader.token_bytes(self.num_layers, self.head_size)
        try:
            return self.tiers.record.nbytes(spec.user_id)
        except Exception:  # noqa: BLE001 — a count is not worth a failed step
            return 0

    def _count_step(self, read: str) -> None:
        if self.counts:
            self.stats.record_load_step(read)

    def _host_time(self, step: str, seconds: float) -> None:
        if self.counts:
            self.stats.record_host_time(step, seconds)

    def _load_failed(self, spec: LoadSpec, exc: Exception) -> None:
        logger.warning("inferscale: loading memory for %s failed (%s: %s); vLLM recomputes the request or "
                       "ends it with an error, as its kv_load_failure_policy says", spec.req_id, type(exc).__name__, exc)
        self._load_errors.update(spec.blocks)
