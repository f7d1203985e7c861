"""The vLLM KV connector: a thin adapter over the vLLM-free write path (:mod:`inferscale.inject`).

Load it with::

    KVTransferConfig(
        kv_connector="InferScaleConnector",
        kv_connector_module_path="inferscale.connector.vllm_adapter",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"config": Config(...).to_dict()},   # or {"config_file": "x.toml"}
    )

Scheduler side (EngineCore process): :mod:`inferscale.inject.planner` decides
how many memory tokens each request skips (an adaptive tail only while the
engine has room: :mod:`inferscale.inject.load_signal`); only a picklable
:class:`InferScaleMetadata` crosses to the workers. Worker side: the KV store's
tiers live here (:func:`~inferscale.storage.tiers.build_tiers`) and
:class:`~inferscale.inject.writer.KVWriter` writes each step's loads into vLLM's
paged cache through the layout read from the caches vLLM registers
(:class:`~inferscale.inject.cache_layout.PagedLayers`), confirmed at engine start by a
one-block self-test per layer. If a layer's layout is not understood, the worker
says so in one log line, writes nothing, and tells the scheduler side
(:class:`InjectionReadiness`, at engine start), which then claims no tokens: every
request is prefilled normally. Loads go before the forward pass or beside the batch (inject/load_mode.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from inferscale import host_memory
from inferscale.compose.rope import RotaryEmbedding
from inferscale.compose.salt import CacheSalts
from inferscale.config import Config
from inferscale.connector import compat
from inferscale.connector.metrics import InferScalePromMetrics, InferScaleStats, stats_or_none
from inferscale.inject.background import BackgroundWriter
from inferscale.inject.background_requests import BackgroundRequests
from inferscale.inject.cache_layout import LayoutError, PagedLayers
from inferscale.inject.load_mode import load_mode
from inferscale.inject.load_signal import EngineLoad
from inferscale.inject.loader import LoadSpec, kv_head_range, load_blocks
from inferscale.inject.planner import NO_MEMORY, Plan, plan_request
from inferscale.inject.report import Fallback, client_report
from inferscale.inject.stats import ConnectorStats
from inferscale.inject.writer import KVWriter
from inferscale.storage.tiers import build_tiers, store_of_record

logger = compat.init_logger("vllm.inferscale.connector")


@dataclass
class InferScaleMetadata(compat.KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)  # written before this step's forward pass
    background_loads: list[LoadSpec] = field(default_factory=list)  # requests held back until reported


def config_from_extra(extra: dict[str, Any] | None) -> Config:
    extra = extra or {}
    if "config" in extra:
        return Config.from_dict(extra["config"])
    if "config_file" in extra:
        return Config.from_toml(extra["config_file"])
    return Config.from_env()


@dataclass
class InjectionReadiness(compat.KVConnectorHandshakeMetadata):
    """A worker's word, at engine start, on whether memory can be written into its caches."""

    ready: bool
    reason: str = ""


def checked_caches(caches: list[torch.Tensor], backend_writes: list, kv_heads: int, head_size: int
                   ) -> tuple[PagedLayers | None, InjectionReadiness]:
    """The caches with their layouts confirmed by the self-test, or None and why not (logged once)."""
    try:
        return PagedLayers.check(caches, backend_writes, kv_heads, head_size), InjectionReadiness(True)
    except LayoutError as exc:
        reason = f"the KV cache layout is not understood: {exc}"
        logger.warning("inferscale: memory injection is off, every request is prefilled normally: %s", reason)
        return None, InjectionReadiness(False, reason)


def claim_nothing(plan: Plan, reason: str) -> Plan:
    """A plan that would inject memory, turned into a fallback: the workers cannot write it."""
    if not plan.num_external:
        return plan
    return replace(plan, num_external=0, claim_len=0, fallback=Fallback.INJECTION_OFF, detail=reason)


class InferScaleConnector(compat.KVConnectorBase_V1):
    """vLLM's view of InferScale: the scheduler side plans each request's memory, the worker
    side hands each step's loads to its :class:`KVWriter`."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        compat.check_release(connector=type(self))
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = config_from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        self.stats = ConnectorStats()
        if role == compat.KVConnectorRole.SCHEDULER:
            #: which requests load their memory in the background (the worker follows the metadata)
            self.load_mode = load_mode(self.config.tuning.async_loads, self.config.kv_store.name,
                                       compat.device_type(vllm_config), self.config.tuning.before_forward_tokens)
            self._beside: set[str] = set()  # requests last told to load in the background
            self.record = store_of_record(self.config)  # the scheduler matches prompts against its indexes
            self.salts = CacheSalts.from_file(self.config.secret_path)  # the worker never needs the secret
            self.blend = self.config.blend(compat.device_type(vllm_config))
            self._plans: dict[str, Plan] = {}
            self._pending: dict[str, Plan] = {}
            self._background = BackgroundRequests()
            self._loaded_blocks: dict[str, set[int]] = {}
            self._failed: set[str] = set()
            self.off_reason = ""  # why the workers cannot inject ("": they can, or have not said)
            self.load = EngineLoad.from_tuning(self.config.tuning)  # room for an adaptive tail?
        else:
            self._init_worker(vllm_config)

    # ---------------- scheduler side ----------------

    def on_new_request(self, request) -> None:
        self.load.arrived(request.request_id)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        req_id = request.request_id
        if req_id in self._failed:  # its load failed: from here on it is prefilled normally
            return 0, False
        began = time.perf_counter()
        plan = plan_request(self.record, self.salts, request.prompt_token_ids or [], request.kv_transfer_params,
                            request.cache_salt, num_computed_tokens, self.blend, partial(self.load.has_room, req_id))
        plan = claim_nothing(plan, self.off_reason) if self.off_reason else plan
        if plan is not NO_MEMORY:
            self._plans[req_id] = plan
            self.stats.record_plan(time.perf_counter() - began)
        beside = plan.num_external > 0 and self.load_mode.beside_batch(
            self.load.alone(req_id), plan.num_external, self.load.loaded_before_forward(besides=req_id))
        if beside:
            self._beside.add(req_id)
        else:
            self._beside.discard(req_id)
        return plan.num_external, beside

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        plan = self._plans.get(request.request_id)
        parked = request.request_id in self._beside and num_external_tokens > 0  # loads first: in no step's work yet
        # (a request parked to load counts too: it joins the batch in a step or two, prefilling as much)
        self.load.admitted(request.request_id, request.num_tokens - (plan.claim_len if plan else 0),
                           0 if parked else num_external_tokens)
        if parked:  # the request is not scheduled: its blocks are known only here
            self._background.allocated(request.request_id, plan, compat.allocated_block_ids(blocks))
        elif num_external_tokens > 0:
            self._pending[request.request_id] = plan

    def build_connector_meta(self, scheduler_output) -> InferScaleMetadata:
        meta = InferScaleMetadata()
        scheduled = [*compat.new_requests(scheduler_output), *compat.resumed_requests(scheduler_output)]
        for req_id, block_ids in scheduled:
            plan = self._pending.pop(req_id, None)
            if plan is not None:
                meta.loads.append(self._load_spec(req_id, plan, block_ids))
        meta.background_loads = [self._load_spec(*load) for load in self._background.to_send()]
        for wait in self._background.scheduled(req_id for req_id, _ in scheduled):
            self.stats.record_parked(wait.until_reported, wait.until_scheduled, wait.seconds)
        self._background.step_built()
        self.load.step_built(compat.scheduled_request_ids(scheduler_output))
        return meta

    def _load_spec(self, req_id: str, plan: Plan, block_ids: list[int]) -> LoadSpec:
        """The load of the plan's tokens into the request's blocks (remembered: a failure names them)."""
        start = plan.claim_len - plan.num_external
        blocks = load_blocks(block_ids, self.block_size, start, plan.claim_len)
        self._loaded_blocks[req_id] = set(blocks)
        return LoadSpec(req_id, plan.request, start, plan.claim_len, plan.segment_len, blocks, self.block_size,
                        plan.epochs, plan.blend.key_scale)

    def update_connector_output(self, connector_output) -> None:
        invalid = getattr(connector_output, "invalid_block_ids", None) or set()
        self._background.arrived(getattr(connector_output, "finished_recving", None) or ())
        for req_id, blocks in self._loaded_blocks.items():
            if blocks & invalid:
                self._failed.add(req_id)

    def set_xfer_handshake_metadata(self, metadata: dict[int, InjectionReadiness]) -> None:
        self.off_reason = next((m.reason for m in metadata.values() if not getattr(m, "ready", True)), "")

    def request_finished(self, request, block_ids, *extra: Any) -> tuple[bool, dict | None]:
        req_id = request.request_id
        self.load.finished(req_id)
        self._beside.discard(req_id)
        plan = self._plans.pop(req_id, None)
        self._pending.pop(req_id, None)
        aborted_loading = self._background.finished(req_id)  # (vLLM frees its blocks when the load is reported)
        loaded = self._loaded_blocks.pop(req_id, None) is not None and not aborted_loading
        if plan is None:
            return False, None
        fallback = Fallback.LOAD_ERROR if req_id in self._failed else plan.fallback
        self._failed.discard(req_id)
        if fallback is not None:
            self.stats.record_fallback(fallback)
            logger.warning("inferscale: request %s prefilled normally (%s): %s", req_id,
                           fallback.value, plan.detail or "the worker could not load the memory")
        else:
            self.stats.record_budget(plan.budget)
            if loaded:
                self.stats.record_injection(plan.num_external)
        report = client_report(fallback, plan.num_external if loaded else 0, plan.recomputed, plan.budget, plan.room)
        return False, {"inferscale": report}

    # ---------------- worker side ----------------

    #: the write policies, before the forward pass and in the background (a subclass may bring its own)
    writer_type: type[KVWriter] = KVWriter
    background_writer_type: type[BackgroundWriter] = BackgroundWriter

    def _init_worker(self, vllm_config) -> None:
        host_memory.start_trimming(host_memory.trim_interval())  # when INFERSCALE_MALLOC_TRIM_S asks for it
        model = vllm_config.model_config
        rank, world = compat.tensor_parallel()
        heads = kv_head_range(model.get_total_num_kv_heads(), world, rank)
        tiers, counts = build_tiers(self.config), rank == 0  # every rank loads the same users: one counts
        self.writer = self._writer(self.writer_type, vllm_config, tiers, heads, counts)
        self.background = self._writer(self.background_writer_type, vllm_config, tiers, heads, counts)
        self._background_queue: list[LoadSpec] = []  # this step's background loads, issued after the forward
        self.layer_names: list[str] = []
        self._layer_of: dict[str, int] = {}
        self.caches: PagedLayers | None = None
        self.readiness = InjectionReadiness(False, "the KV caches were never registered")

    def _writer(self, kind: type[KVWriter], vllm_config, tiers, heads: slice, counts: bool):
        """A writer of ``kind`` with rotary tables of its own (they live on the stream that reads them)."""
        rope = RotaryEmbedding.from_hf_config(compat.text_config(vllm_config))
        return kind(self.config, tiers, rope, heads, vllm_config.model_config.get_head_size(), self.stats, counts)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layer_names = sorted(kv_caches, key=compat.layer_index)
        self._layer_of = {name: index for index, name in enumerate(self.layer_names)}
        tensors = [kv_caches[name] for name in self.layer_names]
        writes = [compat.backend_cache_write(self._vllm_config, name, kv_caches[name]) for name in self.layer_names]
        heads = self.writer.heads.stop - self.writer.heads.start
        self.caches, self.readiness = checked_caches(tensors, writes, heads, self.writer.head_size)
        for writer in (self.writer, self.background):
            writer.register(len(tensors), tensors[0].device, tensors[0].dtype)

    def get_handshake_metadata(self) -> InjectionReadiness:
        return self.readiness

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Queue this step's loads; the forward pass waits for each layer in
        :meth:`wait_for_layer_load`, or for all of them now when it will not ask. Before them,
        the forward stream waits for the background loads reported last step; this step's wait
        for :meth:`get_finished`, after the forward pass was launched."""
        self.background.wait_before_forward()  # loads reported last step: in place before this step's work
        meta = self._get_connector_metadata()
        self._background_queue += getattr(meta, "background_loads", ())
        loads = getattr(meta, "loads", ())
        if loads and self.caches is None:  # nothing is written into a layout not understood
            self.writer.refuse_step(loads)
        elif loads:
            waits = getattr(forward_context, "attn_metadata", None) is not None
            self.writer.write_step(loads, self.caches, waits)

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_of.get(layer_name)
        if index is not None:
            self.writer.wait_layer(index)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        writer = getattr(self, "writer", None)
        if writer is not None:  # whatever the forward pass did not wait for, later work does
            writer.wait_all()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """This step's background loads, issued now, after the forward pass was launched, and
        reported at once with any of earlier steps whose users' reads have ended (or that failed,
        or whose requests were aborted while they waited: vLLM frees their blocks then); the next
        step's forward stream waits for their writes (:meth:`start_load_kv`)."""
        background = getattr(self, "background", None)
        if background is None:
            return None, None
        queued, self._background_queue = self._background_queue, []
        return None, background.step(queued, self.caches, finished_req_ids) or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        writers = [w for w in (getattr(self, "writer", None), getattr(self, "background", None)) if w is not None]
        return set().union(*(writer.take_load_errors() for writer in writers))

    def shutdown(self) -> None:
        if getattr(self, "background", None) is not None:  # nothing is left writing into caches being freed
            self.background.wait()

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
