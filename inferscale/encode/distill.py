"""Teacher-forced reads of a memory segment, with no generation.

What the model predicts over a target (a gold answer, or the answer it gives itself) after the
facts as text — prompt injection, the teacher — and after the facts' stored K/V — the student.
Nothing is sampled, so a difference between two ways of storing facts shows as a difference in
distributions, free of the flips of greedy decoding: the KL divergence from the teacher and the
target's negative log-likelihood. The accuracy screen (``benchmarks/locomo_screen.py``) and the
training of fact wrappers (``benchmarks/train_wrappers.py``) read segments this way.

Gradients flow through :func:`segment_cache` and :func:`cached_logprobs` (a trainer calls them
with autograd on); callers that only measure wrap them in ``torch.no_grad()``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from inferscale.compose.rope import RotaryEmbedding
from inferscale.devices import module_device


def frozen_model(spec: str, dtype: str | None = None) -> tuple[nn.Module, object, str, str]:
    """``(model, tokenizer, device, dtype)``: ``spec`` (an HF directory or a known model name) from
    local files (:func:`~inferscale.encode.weights.load_causal_lm`), on the GPU if there is one, in
    ``dtype`` (default bfloat16 on a GPU, float32 on a CPU), its weights frozen."""
    from inferscale.encode.weights import load_causal_lm

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    model, tokenizer = load_causal_lm(spec, dtype)
    model.requires_grad_(False)
    return model.to(device), tokenizer, device, dtype


def text_logprobs(model: nn.Module, ids: Sequence[int], targets: int) -> torch.Tensor:
    """Log-probabilities ``[targets, vocab]`` (float32) predicting the last ``targets`` of ``ids``,
    the whole sequence read as text from position 0."""
    device = module_device(model)
    logits = model(input_ids=torch.tensor([list(ids)], device=device), logits_to_keep=targets + 1).logits
    return torch.log_softmax(logits[0, :targets].float(), -1)


def segment_cache(model: nn.Module, rope: RotaryEmbedding, keys: torch.Tensor, values: torch.Tensor):
    """The model's cache holding pre-RoPE ``keys``/``values`` ``[layers, tokens, kv_heads, head_size]``
    at positions ``0..tokens-1`` (RoPE applied here, as the connector does)."""
    from transformers import DynamicCache

    dtype, device = model.dtype, module_device(model)
    positions = torch.arange(keys.shape[1], device=device)
    cache = DynamicCache(config=model.config)
    for layer in range(keys.shape[0]):
        k = rope.rotate(keys[layer].to(device, torch.float32), positions).to(dtype)
        cache.update(k.transpose(0, 1)[None], values[layer].to(device, dtype).transpose(0, 1)[None], layer)
    return cache


def cached_logprobs(model: nn.Module, cache, start: int, ids: Sequence[int], targets: int) -> torch.Tensor:
    """Log-probabilities ``[targets, vocab]`` predicting the last ``targets`` of ``ids``, which are read
    after ``cache`` (its ``start`` tokens) at positions ``start..``. The cache is extended in place."""
    device = module_device(model)
    tokens = torch.tensor([list(ids)], device=device)
    positions = torch.arange(start, start + tokens.shape[1], device=device)[None]
    out = model(input_ids=tokens, past_key_values=cache, position_ids=positions, logits_to_keep=targets + 1)
    return torch.log_softmax(out.logits[0, :targets].float(), -1)


def kl_per_token(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) at each position (log-probability rows in, ``[positions]`` out)."""
    return (teacher.exp() * (teacher - student)).sum(-1)


def nll_per_token(logprobs: torch.Tensor, target_ids: Sequence[int]) -> torch.Tensor:
    """The negative log-likelihood of each target token."""
    index = torch.tensor(list(target_ids), device=logprobs.device)[:, None]
    return -logprobs.gather(-1, index)[:, 0]
