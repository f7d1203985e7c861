"""K/V at rest in fp8 (:mod:`inferscale.kv_fp8`): the round trip's error bound, and what a reader refuses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.kv import FactKV
from inferscale.kv_fp8 import (FP8, FP8_E4M3, FP8_MAX, LIMIT, MODEL, SCALE_EXPONENTS, Fp8KV, at_rest, check_dequant,
                               dequantize, dequantize_block, fp8_round_trip, has_nan_code, quantize, quantize_block)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def halfulp(y: torch.Tensor) -> torch.Tensor:
    """Half the spacing of e4m3 around ``|y|`` (float64): 2^(e - 4) in the binade [2^e, 2^(e+1)),
    2^-10 below the normal range (2^-6)."""
    exponent = torch.floor(torch.log2(y.abs().clamp(min=2.0 ** -7))).clamp(min=-6)
    return torch.exp2(exponent - 4)


@st.composite
def blocks(draw):
    """``[2, L, T, H, D]`` K/V of a model dtype: a per-channel bias of up to ``bias`` (Qwen's keys
    carry one of a few hundred) plus a spread of ``10**magnitude``, some channels quieter."""
    layers, tokens, heads, size = (draw(st.integers(1, 3)), draw(st.integers(0, 9)), draw(st.integers(1, 3)),
                                   draw(st.sampled_from([1, 3, 8, 64])))
    dtype = draw(st.sampled_from(DTYPES))
    magnitude, bias = draw(st.floats(-6, 3)), draw(st.sampled_from([0.0, 1.0, 50.0, 354.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31)))
    spread = 10.0 ** magnitude * torch.rand(1, layers, 1, heads, size, generator=gen) ** 4
    offset = bias * torch.randn(2, layers, 1, heads, size, generator=gen)
    return (offset + spread * torch.randn(2, layers, tokens, heads, size, generator=gen)).to(dtype)


@settings(max_examples=300, deadline=None)
@given(blocks())
def test_round_trip_within_half_an_e4m3_ulp_of_the_scale(block):
    """Each element comes back within e4m3's half-ulp at ``(x − o) / s``, times ``s`` (the scale is a
    power of two, so dividing and multiplying by it round nothing), plus one float32 rounding of
    ``o + s q``; cast to the model's dtype, within twice that (x itself is one of the candidates)."""
    codes, dequant = quantize_block(block)
    x, offset, scale = block.double(), dequant[..., :-1].double()[:, :, None], dequant[..., -1].double()
    scale = scale[:, :, None, :, None]
    bound = scale * halfulp((x - offset) / scale) + 2.0 ** -23 * (x.abs() + offset.abs())
    err32 = (dequantize_block(codes, dequant, torch.float32).double() - x).abs()
    assert bool((err32 <= bound).all()), float((err32 - bound).max())
    err = (dequantize_block(codes, dequant, block.dtype).double() - x).abs()
    assert bool((err <= 2 * bound).all()), float((err - 2 * bound).max())


@settings(max_examples=200, deadline=None)
@given(blocks())
def test_scales_are_the_smallest_powers_of_two_that_hold_the_range(block):
    codes, dequant = quantize_block(block)
    check_dequant(dequant, codes)  # powers of two in range, offsets finite, no NaN code
    scale = dequant[..., -1].double()
    amax = (block.double() - dequant[..., :-1].double()[:, :, None]).abs().amax(dim=(2, 4)) \
        if block.shape[2] else torch.zeros_like(scale)
    assert bool((amax <= FP8_MAX * scale).all())
    at_floor = scale == 2.0 ** SCALE_EXPONENTS[0]
    assert bool((at_floor | (amax > FP8_MAX * scale / 2)).all()), "a smaller scale would have held the range"


def test_the_offset_carries_a_large_bias():
    """A key channel of bias 354 and a spread of 1: its error stays a few percent of the spread,
    not of the bias (~11 without the offset)."""
    gen = torch.Generator().manual_seed(0)
    keys = (354.0 + torch.randn(2, 40, 2, 64, generator=gen)).to(torch.bfloat16)
    kv = FactKV(range(40), keys, torch.randn(2, 40, 2, 64, generator=gen).to(torch.bfloat16))
    back = fp8_round_trip(kv)
    assert back.keys.dtype == torch.bfloat16 and back.token_ids == kv.token_ids
    # ≤ 2^-4 of the spread from e4m3, plus one bfloat16 rounding at 354 (2^-9 · 256 = 0.5)
    assert float((back.keys.float() - keys.float()).abs().max()) <= 0.5 + 4 * 2.0 ** -4


def test_fp8_facts_convert_both_ways_and_check_their_parts():
    gen = torch.Generator().manual_seed(1)
    kv = FactKV([5, 6, 7], torch.randn(2, 3, 1, 4, generator=gen), torch.randn(2, 3, 1, 4, generator=gen))
    fp8 = at_rest(kv, FP8_E4M3)
    assert isinstance(fp8, Fp8KV) and fp8.keys.dtype == FP8 and fp8.dtype == torch.float32
    assert fp8.nbytes == 2 * 2 * 3 * 1 * 4 + 2 * 2 * 1 * 5 * 2
    assert at_rest(fp8, FP8_E4M3) is fp8 and at_rest(kv, MODEL) is kv
    back = at_rest(fp8, MODEL)
    assert isinstance(back, FactKV) and torch.equal(back.keys, dequantize(fp8).keys)
    assert dequantize(fp8, torch.float16).keys.dtype == torch.float16
    with pytest.raises(ValueError, match="kv_dtype_at_rest"):
        at_rest(kv, "int4")
    with pytest.raises(ValueError, match="dequant"):
        Fp8KV(fp8.token_ids, fp8.keys, fp8.values, fp8.dequant[:, :, :, :-1], torch.float32)
    with pytest.raises(ValueError, match="e4m3"):
        Fp8KV(fp8.token_ids, fp8.keys.float(), fp8.values, fp8.dequant, torch.float32)
    with pytest.raises(ValueError, match="e4m3"):
        Fp8KV((5, 6), fp8.keys, fp8.values, fp8.dequant, torch.float32)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 2 * LIMIT])
def test_kv_that_fp8_cannot_hold_is_refused(bad):
    keys = torch.zeros(1, 2, 1, 4)
    keys[0, 1, 0, 2] = bad
    with pytest.raises(ValueError, match="finite"):
        quantize(FactKV([1, 2], keys, torch.zeros(1, 2, 1, 4)))


@pytest.mark.parametrize("damage, message", [
    (lambda d, c: d[0, 0, 0, -1].fill_(0.75), "power of two"),
    (lambda d, c: d[1, 0, 0, -1].fill_(-1.0), "power of two"),
    (lambda d, c: d[1, 0, 0, -1].fill_(0.0), "power of two"),
    (lambda d, c: d[0, 0, 0, -1].fill_(2.0 ** 120), "power of two"),
    (lambda d, c: d[0, 0, 0, 0].fill_(float("inf")), "offset"),
    (lambda d, c: c.view(torch.uint8)[0, 0, 0, 0, 0].fill_(0xFF), "NaN"),
    (lambda d, c: c.view(torch.uint8)[1, 1, 2, 0, 3].fill_(0x7F), "NaN"),
])
def test_damaged_scales_offsets_or_codes_are_refused(damage, message):
    codes, dequant = quantize_block(torch.randn(2, 2, 3, 1, 4))
    check_dequant(dequant, codes)
    damage(dequant, codes)
    with pytest.raises(ValueError, match=message):
        check_dequant(dequant, codes)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=600))
def test_a_nan_code_is_found_wherever_it_lies(raw):
    """Either NaN byte of e4m3 (0x7F, 0xFF), anywhere among any others, is found; no other byte is."""
    codes = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(torch.float8_e4m3fn) if raw else \
        torch.empty(0, dtype=torch.float8_e4m3fn)
    assert has_nan_code(codes) == any(byte & 0x7F == 0x7F for byte in raw)
