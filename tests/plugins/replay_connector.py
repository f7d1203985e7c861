"""The strict control: re-inject the K/V vLLM itself computed for the segment.

Same scheduler side, metadata, slot mapping and write op as the product
connector; only the source of the K/V differs: the post-RoPE K/V recorded by
:mod:`vllm_probe` from a plain prefill, written back unchanged. If the write
path is right this must reproduce plain prefill bit for bit.
"""

import torch

import vllm_probe
from inferscale.connector import compat
from inferscale.connector.vllm_adapter import InferScaleConnector


class ReplayConnector(InferScaleConnector):
    def _load(self, spec, forward_context) -> None:
        slots = torch.tensor(spec.slots, dtype=torch.long, device=self.loader.device)
        for index, name in enumerate(self.layer_names):
            key, value = vllm_probe.first_write(index)
            layer = forward_context.no_compile_layers[name]
            kv_cache = compat.layer_kv_cache(layer, forward_context)
            compat.write_kv(layer, key[spec.start:spec.end].contiguous(), value[spec.start:spec.end].contiguous(),
                            kv_cache, slots)
