"""The vLLM KV connector: a thin adapter over the vLLM-free core.

Load it with::

    KVTransferConfig(
        kv_connector="InferScaleConnector",
        kv_connector_module_path="inferscale.connector.vllm_adapter",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"config": Config(...).to_dict()},   # or {"config_file": "x.toml"}
    )

Scheduler side (EngineCore process): :mod:`inferscale.connector.planner` decides
how many memory tokens each request skips; only a picklable
:class:`InferScaleMetadata` crosses to the workers. Worker side: the KV store
lives here; :mod:`inferscale.connector.loader` gathers and rotates the facts'
K/V, :func:`compat.write_kv` writes them through the backend's own op, and
:mod:`inferscale.connector.layer_loads` overlaps that work with the forward
pass, layer by layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from inferscale import host_memory
from inferscale.compose.rope import RotaryEmbedding
from inferscale.compose.salt import CacheSalts
from inferscale.config import Config, build
from inferscale.connector import compat, fused_write
from inferscale.connector import sources as sources_table
from inferscale.compose.segment import Segment
from inferscale.connector.layer_loads import LayerLoads, layer_groups
from inferscale.connector.loader import LoadSpec, SegmentLoader, kv_head_range, load_blocks
from inferscale.connector.metrics import InferScalePromMetrics, InferScaleStats, stats_or_none
from inferscale.connector.planner import NO_MEMORY, Plan, plan_request
from inferscale.connector.report import client_report
from inferscale.connector.sources import Sources
from inferscale.connector.stats import ConnectorStats, Fallback
from inferscale.connector.write_graphs import WriteGraphs
from inferscale.storage.disk import DiskStore

logger = compat.init_logger("vllm.inferscale.connector")


@dataclass
class InferScaleMetadata(compat.KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


def _by_stored_kind(ready: list) -> list[list]:
    """``(spec, sources, tier)`` entries grouped by the stored K/V's dtype and head count."""
    groups: dict[tuple, list] = {}
    for entry in ready:
        groups.setdefault((entry[1].dtype, entry[1].num_heads), []).append(entry)
    return list(groups.values())


def config_from_extra(extra: dict[str, Any] | None) -> Config:
    extra = extra or {}
    if "config" in extra:
        return Config.from_dict(extra["config"])
    if "config_file" in extra:
        return Config.from_toml(extra["config_file"])
    return Config.from_env()


def disk_store(config: Config) -> DiskStore:
    return DiskStore(DiskStore.Options(root=str(config.kv_path)))


class InferScaleConnector(compat.KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        compat.check_release()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = config_from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        self.disk = disk_store(self.config)
        self.stats = ConnectorStats()
        if role == compat.KVConnectorRole.SCHEDULER:
            self.salts = CacheSalts.from_file(self.config.secret_path)  # the worker never needs the secret
            self.blend = self.config.blend(compat.device_type(vllm_config))
            self._plans: dict[str, Plan] = {}
            self._pending: dict[str, Plan] = {}
            self._loaded_blocks: dict[str, set[int]] = {}
            self._failed: set[str] = set()
        else:
            self._init_worker(vllm_config)

    # ---------------- scheduler side ----------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        began = time.perf_counter()
        plan = plan_request(self.disk, self.salts, request.prompt_token_ids or [], request.kv_transfer_params,
                            request.cache_salt, num_computed_tokens, self.blend)
        if plan is not NO_MEMORY:
            self._plans[request.request_id] = plan
            self.stats.record_plan(time.perf_counter() - began)
        return plan.num_external, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._pending[request.request_id] = self._plans[request.request_id]

    def build_connector_meta(self, scheduler_output) -> InferScaleMetadata:
        meta = InferScaleMetadata()
        scheduled = [*compat.new_requests(scheduler_output), *compat.resumed_requests(scheduler_output)]
        for req_id, block_ids in scheduled:
            plan = self._pending.pop(req_id, None)
            if plan is None:
                continue
            start = plan.claim_len - plan.num_external
            blocks = load_blocks(block_ids, self.block_size, start, plan.claim_len)
            meta.loads.append(LoadSpec(req_id, plan.request, start, plan.claim_len, plan.segment_len, blocks,
                                       self.block_size, plan.versions, plan.blend.key_scale))
            self._loaded_blocks[req_id] = set(blocks)
        return meta

    def update_connector_output(self, connector_output) -> None:
        invalid = getattr(connector_output, "invalid_block_ids", None) or set()
        for req_id, blocks in self._loaded_blocks.items():
            if blocks & invalid:
                self._failed.add(req_id)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        req_id = request.request_id
        plan = self._plans.pop(req_id, None)
        self._pending.pop(req_id, None)
        loaded = self._loaded_blocks.pop(req_id, None) is not None
        if plan is None:
            return False, None
        fallback = Fallback.LOAD_ERROR if req_id in self._failed else plan.fallback
        self._failed.discard(req_id)
        if fallback is not None:
            self.stats.record_fallback(fallback)
            logger.warning("inferscale: request %s prefilled normally (%s): %s", req_id,
                           fallback.value, plan.detail or "the worker could not load the memory")
        elif loaded:
            self.stats.record_injection(plan.num_external)
        report = client_report(fallback, plan.num_external if loaded else 0, plan.recomputed)
        return False, {"inferscale": report}

    # ---------------- worker side ----------------

    def _init_worker(self, vllm_config) -> None:
        host_memory.start_trimming(host_memory.trim_interval())  # when INFERSCALE_MALLOC_TRIM_S asks for it
        hf_config = vllm_config.model_config.hf_config
        text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
        self.rope = RotaryEmbedding.from_hf_config(text_config)
        num_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        rank, world = compat.tensor_parallel()
        self.heads = kv_head_range(num_kv_heads, world, rank)
        self._counts_hits = rank == 0  # every rank loads the same users: count them once
        self.head_size = vllm_config.model_config.get_head_size()
        self.store = build("kv_store", self.config.kv_store)
        self.layer_names: list[str] = []
        self._layer_of: dict[str, int] = {}
        self.loader: SegmentLoader | None = None
        self.layer_loads: LayerLoads | None = None
        self._cache_views: fused_write.CacheViews | bool | None = None  # None: not looked at yet
        self._fused_allowed = False  # (set with the caches: register_kv_caches)
        self._write_graphs: WriteGraphs | None = None
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layer_names = sorted(kv_caches, key=compat.layer_index)
        self._layer_of = {name: index for index, name in enumerate(self.layer_names)}
        first = kv_caches[self.layer_names[0]]
        self.loader = SegmentLoader(self.store, self.disk, self.rope, self.heads, first.device, first.dtype,
                                    host_in_place=self.config.tuning.pinned_reads == "overlap",
                                    in_place_from=int(self.config.tuning.pinned_copy_below_mib * 2**20))
        self.layer_loads = LayerLoads(first.device, len(self.layer_names))
        #: whether the fused write may run here (its sources table's loop compiled now, not on the
        #: first request's path); whether it can, the cache layout decides (:meth:`_fused_views`)
        self._fused_allowed = self.config.tuning.fused_write and fused_write.available() and sources_table.ready()
        #: the launches of an in-place read of host memory (pinned_reads = "overlap"), a group of layers each
        self._host_groups = tuple(layer_groups(len(self.layer_names), self.config.tuning.pinned_read_launches))

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Queue this step's loads; the forward pass waits for each layer in
        :meth:`wait_for_layer_load`, or for all of them now when it will not ask."""
        loads = getattr(self._get_connector_metadata(), "loads", ())
        if not loads:
            return
        if self.loader is None:
            raise RuntimeError("KV caches were never registered with the connector")
        began = time.perf_counter()
        fused = self._fused_views(forward_context) is not None
        in_place = fused and self.loader.step_in_place(loads, len(self.layer_names), self.head_size)
        # one kernel from GPU memory runs before the forward on its own stream; reads of host
        # memory in place (pinned_reads = "overlap") and the per-layer path overlap it from a side stream
        with self.layer_loads.issuing(side_stream=not fused or in_place):
            if fused:
                self._write_fused(loads, in_place)
            else:
                self._write(forward_context, self._prepare(loads))
        if getattr(forward_context, "attn_metadata", None) is None:
            self.layer_loads.wait_all()
        self._host_time("load", time.perf_counter() - began)

    def _fused_views(self, forward_context) -> fused_write.CacheViews | None:
        """The paged caches as the fused kernel addresses them; None when it is off
        (``Config.fused_write``) or cannot run (no Triton, the CPU, a store that cannot hand
        out its blocks, a cache layout or dtype it does not know, no Numba to build its
        sources table): then each layer is written through the backend's op."""
        if self._cache_views is None:
            self._cache_views = False
            views = [compat.kv_cache_views(forward_context.no_compile_layers[name], forward_context)
                     for name in self.layer_names]
            if self._fused_allowed and hasattr(self.store, "blocks") and all(views):
                self._cache_views = fused_write.CacheViews.of(views)
                if self.config.tuning.write_graphs and self._cache_views.bases.device.type == "cuda":
                    self._write_graphs = WriteGraphs(self._cache_views, self.heads.start, self.rope.rotary_dim,
                                                     self.rope.style == "neox")
        return self._cache_views or None

    def _write_fused(self, loads, in_place: bool) -> None:
        """One kernel writes every layer for every request of the step, queued on the forward
        stream itself (nothing to synchronise; the forward's wait at layer 0 is then free). From
        host memory, a few launches of a group of layers each, on the side stream: each layer's
        attention waits for its group only."""
        ready: list[tuple[LoadSpec, Sources, str]] = []
        for spec in loads:
            try:
                tier = self._tier(spec)
                ready.append((spec, self.loader.sources(spec, len(self.layer_names), self.head_size, in_place), tier))
            except Exception as exc:  # never crash the engine: report the blocks, vLLM recomputes
                self._load_failed(spec, exc)
        keep, done = [], None  # done: an event recorded after the last work queued, if one was
        for group in _by_stored_kind(ready):  # one group unless facts were stored in two dtypes
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
            for _, _, tier in group:
                self._count_hit(tier)
        if keep:
            self.layer_loads.all_queued(keep, done)

    def _launch_fused(self, sources: Sources, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[Sources, torch.cuda.Event | None]:
        """From GPU memory: one replay of a CUDA graph (``Config.write_graphs``), else one launch,
        on the current stream. From host memory: a launch per group of layers, each group's event
        recorded, all replayed from one graph with ``Config.pinned_read_graphs``. Returns the
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
        sources = sources.to(self.loader.device)
        neox = self.rope.style == "neox"
        for layers in groups or [None]:
            fused_write.write_tokens(self._cache_views, sources, cos, sin, self.heads.start,
                                     self.rope.rotary_dim, neox, layers, programs)
            if host:
                self.layer_loads.group_queued(layers, [sources] if layers == groups[-1] else None)
        return sources, None

    def _prepare(self, loads) -> list[tuple[LoadSpec, Segment, torch.Tensor]]:
        ready = []
        for spec in loads:
            try:
                ready.append((spec, self._segment(spec), self.loader.slot_mapping(spec)))
            except Exception as exc:  # never crash the engine: report the blocks, vLLM recomputes
                self._load_failed(spec, exc)
        return ready

    def _segment(self, spec: LoadSpec) -> Segment:
        tier = self._tier(spec)
        segment = self.loader.load(spec, len(self.layer_names), self.head_size)
        self._count_hit(tier)
        return segment

    def _tier(self, spec: LoadSpec) -> str:
        """Where the request's memory is found: the memory tier, or the disk behind it."""
        return self.store.name if self.store.has_user(spec.user_id) else self.disk.name

    def _count_hit(self, tier: str) -> None:
        if self._counts_hits:
            self.stats.record_hit(tier)

    def _write(self, forward_context, ready: list[tuple[LoadSpec, Segment, torch.Tensor]]) -> None:
        """Each layer's K/V for every request, then that layer's event."""
        failed: set[str] = set()
        for index, name in enumerate(self.layer_names):
            layer = forward_context.no_compile_layers[name]
            kv_cache = compat.layer_kv_cache(layer, forward_context)
            for spec, segment, slots in ready:
                if spec.req_id in failed:
                    continue
                try:
                    compat.write_kv(layer, segment.keys[index], segment.values[index], kv_cache, slots)
                except Exception as exc:  # the blocks are reported; vLLM recomputes them
                    failed.add(spec.req_id)
                    self._load_failed(spec, exc)
            self.layer_loads.layer_queued(index)

    def _load_failed(self, spec: LoadSpec, exc: Exception) -> None:
        logger.warning("inferscale: loading memory for %s failed (%s: %s); it will be recomputed",
                       spec.req_id, type(exc).__name__, exc)
        self._load_errors.update(spec.blocks)

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_of.get(layer_name)
        if index is not None and self.layer_loads.is_pending(index):
            began = time.perf_counter()
            self.layer_loads.wait_layer(index)
            self._host_time("wait", time.perf_counter() - began)

    def _host_time(self, step: str, seconds: float) -> None:
        if self._counts_hits:  # every rank does the same work: rank 0 counts it
            self.stats.record_host_time(step, seconds)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        loads = getattr(self, "layer_loads", None)
        if loads is not None:  # whatever the forward pass did not wait for, later work does
            loads.wait_all()

    # ---------------- stats (both sides) ----------------

    def get_kv_connector_stats(self) -> InferScaleStats | None:
        """What this side counted since vLLM last asked (the scheduler side: requests
        and fallbacks; the worker side: store hits); shown on ``/metrics``."""
        return stats_or_none(self.stats.take())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> InferScaleStats:
        return InferScaleStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return InferScalePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
