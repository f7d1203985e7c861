"""The inverse frequencies of each RoPE type, as transformers and vLLM compute them.

:func:`rope_parameters` reads a Hugging Face config's RoPE parameters (either generation of
transformers); :data:`INV_FREQ_FNS` maps each ``rope_type`` (default, linear, dynamic NTK,
llama3, yarn, longrope) to the function that gives its float32 ``inv_freq`` and attention
scaling. :class:`inferscale.compose.rope.RotaryEmbedding` applies them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from inferscale.errors import ConfigError

DEFAULT_THETA = 10_000.0
# RoPE types whose parameters include the pretraining context length.
_NEEDS_ORIGINAL_MAX = frozenset({"llama3", "yarn", "longrope"})

InvFreqFn = Callable[[Mapping[str, Any], int, int, int | None], tuple[torch.Tensor, float]]


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE parameters as one flat dict, however the config stores them.

    transformers >= 5 keeps them all in ``config.rope_parameters`` (``rope_theta``
    and ``partial_rotary_factor`` included; ``rope_scaling`` is an alias).
    transformers 4.x kept ``config.rope_theta`` and ``config.rope_scaling``
    (``None`` without scaling, type under ``"type"`` or ``"rope_type"``).
    """
    stored = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if any(isinstance(value, Mapping) for value in stored.values()):
        raise ConfigError(f"per-layer-type RoPE parameters ({sorted(stored)}) are not supported")
    params = dict(stored)
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or DEFAULT_THETA
    if params.get("partial_rotary_factor") is None and getattr(config, "partial_rotary_factor", None) is not None:
        params["partial_rotary_factor"] = config.partial_rotary_factor
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] in _NEEDS_ORIGINAL_MAX:
        # as transformers: a top-level config attribute (Phi-3) wins over the rope parameters
        params["original_max_position_embeddings"] = (
            getattr(config, "original_max_position_embeddings", None)
            or params.get("original_max_position_embeddings")
            or config.max_position_embeddings
        )
    return params


def _exponents(dim: int) -> torch.Tensor:
    """``2i / dim`` for each rotary pair, as float32."""
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _default(
    params: Mapping[str, Any], dim: int, max_positions: int, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    """Plain RoPE: ``theta ** (-2i / dim)``."""
    return 1.0 / (params["rope_theta"] ** _exponents(dim)), 1.0


def _linear(
    params: Mapping[str, Any], dim: int, max_positions: int, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    """Position interpolation: every frequency divided by ``factor``."""
    inv_freq, _ = _default(params, dim, max_positions, seq_len)
    return inv_freq / params["factor"], 1.0


def _dynamic(
    params: Mapping[str, Any], dim: int, max_positions: int, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    """Dynamic NTK: theta grows with the sequence length beyond ``max_positions``.

    Beyond ``max_positions`` the new theta is computed in float32 tensors, as
    transformers does at run time, so the frequencies match it bit for bit.
    """
    if seq_len is None or seq_len <= max_positions:
        return _default(params, dim, max_positions, seq_len)
    factor = params["factor"]
    ratio = factor * torch.tensor(seq_len) / max_positions - (factor - 1)
    theta = params["rope_theta"] * ratio ** (dim / (dim - 2))
    return 1.0 / (theta ** _exponents(dim)), 1.0


def _llama3(
    params: Mapping[str, Any], dim: int, max_positions: int, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between."""
    inv_freq, _ = _default(params, dim, max_positions, seq_len)
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 when not scaling)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(num_rotations: float, dim: int, theta: float, max_positions: int) -> float:
    """The rotary dim whose wavelength fits ``num_rotations`` times in ``max_positions``."""
    return (dim * math.log(max_positions / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))


def _yarn(
    params: Mapping[str, Any], dim: int, max_positions: int, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp between; scale attention by mscale."""
    theta, old_context = params["rope_theta"], params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_positions / old_context
    scaling = params.get("attention_factor")
    if scaling is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            scaling = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            scaling = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1
    low = _yarn_correction_dim(beta_fast, dim, theta, old_context)
    high = _yarn_correction_dim(beta_slow, dim, theta, old_context)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = theta ** _exponents(dim)
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, float(scaling)


def _longrope(
    params: Mapping[str, Any], dim: int, max_positions: int, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-frequency rescale factors, long ones beyond the pretraining length."""
    old_context = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_positions / old_context
    scaling = params.get("attention_factor")
    if scaling is None:
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_context))
    long = seq_len is not None and seq_len > old_context
    ext_factors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext_factors * params["rope_theta"] ** _exponents(dim)), float(scaling)


INV_FREQ_FNS: dict[str, InvFreqFn] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
}
