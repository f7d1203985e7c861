"""Facts' K/V at rest in fp8 (e4m3): half the bytes in host memory, on disk and over the bus.

``Config.kv_dtype_at_rest = "fp8_e4m3"`` keeps each fact as :class:`Fp8KV`: one byte per element
(``torch.float8_e4m3fn``) and, per K/V, layer and KV head, ``head_size`` offsets and one scale::

    x  ≈  o + s · q        q = e4m3((x − o) / s)

``o`` is the fact's mean of each channel over its tokens (rounded to bfloat16) and ``s`` a power of
two, the smallest with ``|x − o| ≤ 448 s`` (448: e4m3's largest finite value). The injection
dequantizes (the fused cache write as it reads a token, :mod:`inferscale.inject.fused_write`; the
per-layer path before it rotates the keys), so keys are still rotated from pre-RoPE K/V and the
relocation stays exact; only the stored values are rounded.

Why this form (``benchmarks/fp8_at_rest.py``: 120 LoCoMo facts, 4,441 tokens of real bf16 K/V of
Qwen2.5-Coder-0.5B; ``benchmarks/results/fp8_at_rest_qwen05_cpu.md``):

* **The offset is what matters.** e4m3 is a floating format: every element keeps 3 mantissa bits
  (a relative error of at most 2^-4) whatever the scale, as long as it does not fall below the
  normal range (2^-6 of the scale's 448). A Qwen key channel that carries the key bias (|b| up to
  ~211 on the 0.5B, ~354 on the 1.5B) then loses ~3 % of |b| — more than what its tokens say. Quantizing
  ``k − o`` cut the keys' error, measured against what varies over a fact's tokens, from 25 % to
  2.7 % (in the worst layer and head from 2.8 times what varies to 3 %; the model's key bias as
  ``o``: 3.9 %; the fact's own mean fits better, and needs no model to read the file back). Values
  gain a little too (3.0 % to 2.7 %), and one rule serves both.
* **The scale's granularity hardly does.** With a power-of-two scale, a finer scale (per token)
  moves no element between mantissas: the same 2.7 % (a scale fitted to each token's maximum,
  not a power of two, gets 2.4 % for 6 % more bytes at head size 64). So one scale per fact,
  layer and head.
* **A power of two is exact.** ``(x − o) / s`` and ``s · q`` round nothing, so the round trip's only
  error is e4m3's own rounding: ``|o + s q − x| ≤ s · halfulp(|x − o| / s)`` (plus one float32
  rounding of the sum), which ``tests/test_kv_fp8.py`` checks; and the scale is exact in bfloat16,
  so offsets and scales share one tensor (:attr:`Fp8KV.dequant`).

The cost: ``2 · L · H · (D + 1)`` bfloat16 numbers per fact beside ``2 · L · T · H · D`` bytes, so
a fact of T tokens takes ``(T + 2 + 2/D) / (2 T)`` of its bf16 size (~0.53 at T = 35).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from inferscale.kv import FactKV, token_ids_valid

#: ``Config.kv_dtype_at_rest``: facts kept in the model's dtype, or in fp8 e4m3
MODEL, FP8_E4M3 = "model", "fp8_e4m3"
AT_REST = (MODEL, FP8_E4M3)
FP8 = torch.float8_e4m3fn
#: e4m3's largest finite value (its codes 0x7F and 0xFF are NaN, never stored)
FP8_MAX = 448.0
#: the dtype of the offsets and scales (:attr:`Fp8KV.dequant`)
DEQUANT_DTYPE = torch.bfloat16
#: scales are powers of two in 2**SCALE_EXPONENTS[0] .. 2**SCALE_EXPONENTS[1] (normal in float32 and bfloat16)
SCALE_EXPONENTS = (-126, 110)
#: K/V of larger magnitude are refused (the scale could not stay in range)
LIMIT = 2.0 ** 110


def check_at_rest(value: object) -> str:
    """``value`` if it names a form of K/V at rest (:data:`AT_REST`), else a ValueError."""
    if value not in AT_REST:
        raise ValueError(f"kv_dtype_at_rest must be one of {', '.join(AT_REST)}, got {value!r}")
    return value  # type: ignore[return-value]


@dataclass
class Fp8KV:
    """One fact's pre-RoPE K/V in fp8: ``keys`` and ``values`` e4m3 ``[L, T, H, D]``, and ``dequant``
    bfloat16 ``[2, L, H, D + 1]``: for keys (0) and values (1), each layer and head, the ``D``
    offsets then the scale. ``dtype``: the model's, what :func:`dequantize` gives back."""

    token_ids: tuple[int, ...]
    keys: torch.Tensor
    values: torch.Tensor
    dequant: torch.Tensor
    dtype: torch.dtype

    def __post_init__(self):
        self.token_ids = tuple(int(t) for t in self.token_ids)
        if not token_ids_valid(self.token_ids):
            raise ValueError(f"token ids must lie in 0..2**63-1, got {self.token_ids[:8]}...")
        layers, tokens, heads, size = self.keys.shape if self.keys.dim() == 4 else (0, -1, 0, 0)
        if self.keys.dtype != FP8 or self.values.dtype != FP8 or self.values.shape != self.keys.shape \
                or tokens != len(self.token_ids):
            raise ValueError(f"fp8 keys and values must both be e4m3 [layers, {len(self.token_ids)} tokens, kv_heads, "
                             f"head_size], got {self.keys.dtype} {tuple(self.keys.shape)} and {self.values.dtype} "
                             f"{tuple(self.values.shape)}")
        if self.dequant.dtype != DEQUANT_DTYPE or tuple(self.dequant.shape) != (2, layers, heads, size + 1):
            raise ValueError(f"dequant must be bfloat16 [2, {layers}, {heads}, {size + 1}], got "
                             f"{self.dequant.dtype} {tuple(self.dequant.shape)}")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.dequant.nbytes


def quantize(kv: FactKV) -> Fp8KV:
    """``kv`` in fp8 (the module's rule); a ValueError for K/V that are not finite or beyond :data:`LIMIT`."""
    block, dequant = quantize_block(torch.stack((kv.keys.detach(), kv.values.detach())).cpu())
    return Fp8KV(kv.token_ids, block[0], block[1], dequant, kv.keys.dtype)


def dequantize(kv: Fp8KV, dtype: torch.dtype | None = None) -> FactKV:
    """``kv`` back in ``dtype`` (default: the model's), computed in float32."""
    block = dequantize_block(torch.stack((kv.keys, kv.values)), kv.dequant, dtype or kv.dtype)
    return FactKV(kv.token_ids, block[0], block[1])


def fp8_round_trip(kv: FactKV) -> FactKV:
    """``kv`` as a store at rest in fp8 gives it back: what injection reads (for accuracy screens)."""
    return dequantize(quantize(kv))


def at_rest(kv: FactKV | Fp8KV, form: str) -> FactKV | Fp8KV:
    """``kv`` in ``form`` (:data:`AT_REST`): quantized, dequantized, or as it is."""
    if form == FP8_E4M3:
        return kv if isinstance(kv, Fp8KV) else quantize(kv)
    check_at_rest(form)
    return dequantize(kv) if isinstance(kv, Fp8KV) else kv


def all_at_rest(facts: Mapping[str, FactKV | Fp8KV], form: str) -> dict[str, FactKV | Fp8KV]:
    """Every fact of ``facts`` in ``form`` (:func:`at_rest`), in order."""
    return {fact_id: at_rest(kv, form) for fact_id, kv in facts.items()}


def quantize_block(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[2, L, T, H, D]`` block as (e4m3 ``[2, L, T, H, D]``, bfloat16 dequant ``[2, L, H, D + 1]``)."""
    x = block.float()
    if not bool(torch.isfinite(x).all()) or (x.numel() and float(x.abs().max()) > LIMIT):
        raise ValueError(f"K/V at rest in fp8 must be finite and at most {LIMIT:g} in magnitude")
    offset = (x.sum(dim=2) / max(x.shape[2], 1)).to(DEQUANT_DTYPE)  # (a fact of no tokens: zeros)
    centred = x - offset.float()[:, :, None]
    amax = centred.abs().amax(dim=(2, 4)) if x.shape[2] else x.new_zeros(x.shape[:2] + x.shape[3:4])
    scale = _scale(amax)
    codes = (centred / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, torch.cat((offset, scale.to(DEQUANT_DTYPE)[..., None]), dim=-1)


def dequantize_block(codes: torch.Tensor, dequant: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``o + s · q`` of an e4m3 ``[2, L, T, H, D]`` block and its ``[2, L, H, D + 1]`` dequant, in
    float32, cast once to ``dtype`` (on the block's device)."""
    dequant = dequant.to(codes.device).float()
    offset, scale = dequant[..., :-1], dequant[..., -1]
    return (codes.float() * scale[:, :, None, :, None] + offset[:, :, None]).to(dtype)


def check_dequant(dequant: torch.Tensor, *codes: torch.Tensor) -> None:
    """A ValueError unless every scale is a power of two in range, every offset finite, and no
    code is NaN: what a reader verifies before any of it can reach a cache."""
    scale, offset = dequant[..., -1].float(), dequant[..., :-1].float()
    mantissa, exponent = torch.frexp(scale)
    low, high = SCALE_EXPONENTS
    if not bool(((mantissa == 0.5) & (exponent - 1 >= low) & (exponent - 1 <= high)).all()):
        raise ValueError("an fp8 scale is not a power of two in range")
    if not bool(torch.isfinite(offset).all()):
        raise ValueError("an fp8 offset is not finite")
    if any(has_nan_code(c) for c in codes):
        raise ValueError("an fp8 code is NaN")


def has_nan_code(codes: torch.Tensor) -> bool:
    """Whether an e4m3 tensor holds a NaN. Its NaNs are the bytes 0x7F and 0xFF, the largest a byte
    can be read as int8 and as uint8: two reductions find them, with no temporary the size of the
    codes (masking and comparing every byte cost a memory tier a third of each user it filled)."""
    if not codes.numel():
        return False
    raw = codes.view(torch.uint8)
    return int(raw.max()) == 0xFF or int(raw.view(torch.int8).max()) == 0x7F


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``s`` in range with ``amax <= 448 s`` (exact: the comparison is)."""
    low, high = SCALE_EXPONENTS
    exponent = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(low, high)
    scale = torch.exp2(exponent)
    return torch.where(amax > FP8_MAX * scale, 2 * scale, scale)
