"""Model introspection and the forward hooks that record each layer's pre-RoPE K/V.

:func:`attention_modules` finds the decoder's attention modules; :class:`KVCapture` hooks the
last stage before RoPE of each (the k/v norm where the model has one, else the projection)
and keeps its output as ``[batch, seq, kv_heads, head_size]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from inferscale.errors import ModelMismatchError


def text_config(model: nn.Module):
    """The decoder's config (multimodal models nest it)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def has_sliding_window(config) -> bool:
    """Whether any layer attends through a sliding window (there the shared prefill is not used)."""
    types = getattr(config, "layer_types", None)
    if types:
        return any(t != "full_attention" for t in types)
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True)


def model_name(model: nn.Module) -> str:
    return f"{type(model).__name__} ({getattr(text_config(model), 'model_type', '?')})"


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The decoder's attention modules in layer order; each must have k_proj and v_proj."""
    found = [
        m
        for m in model.modules()
        if isinstance(getattr(m, "k_proj", None), nn.Module)
        and isinstance(getattr(m, "v_proj", None), nn.Module)
        and isinstance(getattr(m, "layer_idx", None), int)
    ]
    expected = text_config(model).num_hidden_layers
    if not found:
        raise ModelMismatchError(
            f"{model_name(model)} is not supported by the fact encoder: no attention module with "
            f"separate k_proj / v_proj projections (fused QKV projections are not supported)"
        )
    if len(found) != expected:
        raise ModelMismatchError(
            f"{model_name(model)}: found {len(found)} attention modules with k_proj/v_proj, "
            f"but the config has {expected} layers"
        )
    return sorted(found, key=lambda m: m.layer_idx)


def _to_bthd(out: torch.Tensor, inp: torch.Tensor, seq: int, heads: int) -> torch.Tensor:
    """A hooked output as ``[batch, seq, heads, head_size]``.

    Projections give ``[B, T, H*D]``; norms get a ``[B, T, H, D]`` view (Qwen3)
    or its ``[B, H, T, D]`` transpose (Gemma3): when T == H the input's strides
    tell which.
    """
    if out.dim() == 3:
        return out.unflatten(-1, (heads, -1))
    if seq == heads:
        heads_first = inp.stride(1) < inp.stride(2)
    else:
        heads_first = out.shape[1] == heads
    return out.transpose(1, 2) if heads_first else out


def _last_stage(attn: nn.Module, norm: str, proj: str) -> nn.Module:
    """The module whose output is the cached tensor before RoPE: the norm if any."""
    module = getattr(attn, norm, None)
    return module if isinstance(module, nn.Module) else getattr(attn, proj)


class KVCapture:
    """Forward hooks recording every layer's pre-RoPE keys and values for one batch."""

    def __init__(self, attn: Sequence[nn.Module], num_kv_heads: int, head_size: int):
        self.attn, self.num_kv_heads, self.head_size = list(attn), num_kv_heads, head_size
        self.keys: list[torch.Tensor | None] = [None] * len(self.attn)
        self.values: list[torch.Tensor | None] = [None] * len(self.attn)
        self.seq = 0
        self._handles: list[Any] = []

    def __enter__(self) -> KVCapture:
        for i, module in enumerate(self.attn):
            k_src = _last_stage(module, "k_norm", "k_proj")
            v_src = _last_stage(module, "v_norm", "v_proj")
            self._handles.append(k_src.register_forward_hook(self._hook(self.keys, i)))
            self._handles.append(v_src.register_forward_hook(self._hook(self.values, i)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, store: list, layer: int):
        def hook(module, args, output):
            out = _to_bthd(output, args[0], self.seq, self.num_kv_heads)
            if out.shape[1:] != (self.seq, self.num_kv_heads, self.head_size):
                raise ModelMismatchError(
                    f"layer {layer}: captured {tuple(output.shape)}, expected "
                    f"[batch, {self.seq}, {self.num_kv_heads}, {self.head_size}]"
                )
            store[layer] = out.detach()

        return hook


def key_biases(attn: Sequence[nn.Module], num_kv_heads: int, head_size: int) -> torch.Tensor:
    """Per layer, the bias in the keys the encoder stores, ``[layers, kv_heads, head_size]``
    (float32, on the CPU): the key projection's bias, zero where it has none or where a k_norm
    after the projection is what is stored."""
    out = torch.zeros(len(attn), num_kv_heads, head_size)
    for layer, module in enumerate(attn):
        bias = getattr(module.k_proj, "bias", None)
        if not isinstance(getattr(module, "k_norm", None), nn.Module) and bias is not None:
            out[layer] = bias.detach().float().cpu().view(num_kv_heads, head_size)
    return out
