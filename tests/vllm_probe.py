"""Records the K/V vLLM itself writes into its paged cache (post-RoPE), per layer.

Installed into an in-process engine's worker with ``llm.apply_model(install)``;
it wraps each attention layer's ``impl.do_kv_cache_update`` (the backend's own
cache-write op), so what it sees is exactly what vLLM stores.
"""

from __future__ import annotations

import torch

RECORDS: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def install(model) -> int:
    from vllm.model_executor.layers.attention.attention import Attention

    count = 0
    for module in model.modules():
        if isinstance(module, Attention) and not getattr(module.impl, "_inferscale_probe", False):
            _wrap(module)
            count += 1
    return count


def _wrap(layer) -> None:
    impl, name = layer.impl, layer.layer_name
    original = impl.do_kv_cache_update

    def record(attn_layer, key, value, kv_cache, slot_mapping):
        n = slot_mapping.shape[0]
        RECORDS.setdefault(name, []).append((key[:n].detach().clone(), value[:n].detach().clone()))
        return original(attn_layer, key, value, kv_cache, slot_mapping)

    impl.do_kv_cache_update = record
    impl._inferscale_probe = True


def first_write(layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of the first cache write of one layer since the last :func:`clear`."""
    from inferscale.connector.compat import layer_index as index_of

    (name,) = [n for n in RECORDS if index_of(n) == layer_index]
    return RECORDS[name][0]


def clear() -> None:
    RECORDS.clear()
