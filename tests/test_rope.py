"""Chunked RoPE (:mod:`inferscale.compose.rope`) matches each model's own rotary embedding.

Property tests over random positions (up to 128k), heads, head sizes, dtypes and
the RoPE configs of Llama-3.1, Qwen2.5 (plain and YaRN), Qwen3, Mistral and
Phi-3 (partial rotary, LongRoPE), plus linear, dynamic-NTK and DeepSeek-style
YaRN (mscale) variants:

(a) ``rotate`` at p equals transformers' own ``apply_rotary_pos_emb`` with cos/sin
    from the model's ``*RotaryEmbedding`` built from the same config;
(b) ``<R_a q, R_b k> = <q, R_{b-a} k> * scaling**2`` (scores depend only on b - a);
(c) relocating from p to p + delta equals rotating at p + delta;
(d) ``inverse`` undoes ``rotate``;
(e) ``rotate_range`` (the serving path: a cos/sin table grown by doubling) is ``rotate`` at
    consecutive positions, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GPTJConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config
from transformers.models.gptj import modeling_gptj
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.phi3 import modeling_phi3
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3
from transformers.utils import logging as hf_logging

from inferscale.compose.rope import RotaryEmbedding
from inferscale.errors import ConfigError, ModelMismatchError

hf_logging.set_verbosity_error()  # configs with deliberately odd sizes warn about token ids

MAX_POSITION = 131_072
HEAD_DIMS = (32, 64, 80, 128)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Max |actual - expected| allowed, as a fraction of max |expected| (the tensor's magnitude).
# float32: we mirror transformers' float32 ops (angle = float(p) * inv_freq, then cos/sin),
#   so rotate is bit-exact; relocate/inverse add only a few float32 roundings (2^-24 each).
# bfloat16 / float16: we compute in float32 and round once at the end, while transformers
#   computes in the input dtype (cos/sin and every product rounded). So for these dtypes
#   (a) compares with transformers run in float32 on the same (bf16/fp16-valued) input, then
#   rounded to the dtype. One rounding costs <= 2^-8 (bf16) / 2^-11 (fp16) of the magnitude
#   and the properties chain at most three, hence 4 roundings' worth.
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2**-6, torch.float16: 2**-9}
# A float32 angle p * inv_freq is rounded to within 2^-24 of itself: property (b) compares
# rotations by three different rounded angles (a, b, b - a), so it allows that much more.
ANGLE_ROUNDING = 2**-24


@dataclass(frozen=True)
class ModelCase:
    """A model's RoPE config (for a given head size) and its transformers implementation."""

    name: str
    make_config: Callable[[int], Any]
    modeling: Any  # the transformers modeling module: *RotaryEmbedding and apply_rotary_pos_emb
    rotary_class: str

    def config(self, head_dim: int) -> Any:
        return self.make_config(head_dim)

    def hf_rotate(self, config: Any, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """transformers' rotation of ``x`` [T, H, D] at ``positions``, in ``x``'s dtype."""
        rotary = getattr(self.modeling, self.rotary_class)(config)  # fresh: dynamic RoPE keeps state
        cos, sin = rotary(x, positions[None])
        q = x.transpose(0, 1)[None]  # [1, H, T, D], transformers' attention layout
        rotated, _ = self.modeling.apply_rotary_pos_emb(q, q, cos, sin)
        return rotated[0].transpose(0, 1)


def _sizes(head_dim: int) -> dict[str, Any]:
    return dict(hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=2,
                num_hidden_layers=1, intermediate_size=64, vocab_size=128)


def _phi3(head_dim: int, partial: float, scaling: dict | None) -> Phi3Config:
    return Phi3Config(**_sizes(head_dim), pad_token_id=None, bos_token_id=None, eos_token_id=None,
                      max_position_embeddings=MAX_POSITION, original_max_position_embeddings=4096,
                      partial_rotary_factor=partial, rope_scaling=scaling)


def _longrope(head_dim: int) -> dict:
    pairs = int(head_dim * 0.75) // 2
    return {"rope_type": "longrope",
            "short_factor": torch.linspace(1.0, 2.0, pairs).tolist(),
            "long_factor": torch.linspace(1.0, 40.0, pairs).tolist()}


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
QWEN25_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}  # as Qwen2.5's model cards
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                 "mscale_all_dim": 0.8, "beta_fast": 16, "beta_slow": 2, "truncate": False}

CASES = (
    ModelCase("llama-3.1", lambda d: LlamaConfig(**_sizes(d), head_dim=d, rope_theta=500_000.0,
              rope_scaling=dict(LLAMA3_SCALING), max_position_embeddings=MAX_POSITION),
              modeling_llama, "LlamaRotaryEmbedding"),
    ModelCase("qwen2.5", lambda d: Qwen2Config(**_sizes(d), rope_theta=1e6, max_position_embeddings=32768),
              modeling_qwen2, "Qwen2RotaryEmbedding"),
    ModelCase("qwen2.5-yarn", lambda d: Qwen2Config(**_sizes(d), rope_theta=1e6, rope_scaling=dict(QWEN25_YARN),
              max_position_embeddings=MAX_POSITION), modeling_qwen2, "Qwen2RotaryEmbedding"),
    ModelCase("qwen3", lambda d: Qwen3Config(**_sizes(d), head_dim=d, rope_theta=1e6, max_position_embeddings=40960),
              modeling_qwen3, "Qwen3RotaryEmbedding"),
    ModelCase("mistral", lambda d: MistralConfig(**_sizes(d), head_dim=d, rope_theta=1e6,
              max_position_embeddings=32768), modeling_mistral, "MistralRotaryEmbedding"),
    ModelCase("linear", lambda d: LlamaConfig(**_sizes(d), head_dim=d, max_position_embeddings=16384,
              rope_scaling={"rope_type": "linear", "factor": 4.0}), modeling_llama, "LlamaRotaryEmbedding"),
    ModelCase("dynamic", lambda d: LlamaConfig(**_sizes(d), head_dim=d, max_position_embeddings=8192,
              rope_scaling={"rope_type": "dynamic", "factor": 4.0}), modeling_llama, "LlamaRotaryEmbedding"),
    ModelCase("yarn-mscale", lambda d: Qwen3Config(**_sizes(d), head_dim=d, rope_scaling=dict(DEEPSEEK_YARN),
              max_position_embeddings=163840), modeling_qwen3, "Qwen3RotaryEmbedding"),
    ModelCase("phi3-partial", lambda d: _phi3(d, 0.5, None), modeling_phi3, "Phi3RotaryEmbedding"),
    ModelCase("phi3-longrope", lambda d: _phi3(d, 0.75, _longrope(d)), modeling_phi3, "Phi3RotaryEmbedding"),
)

positions_lists = st.lists(st.integers(0, MAX_POSITION), min_size=1, max_size=16)


def _random(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """``actual`` within TOLERANCE[dtype] of ``expected``'s magnitude."""
    error = (actual.double() - expected.double()).abs().max().item()
    bound = TOLERANCE[dtype] * max(expected.double().abs().max().item(), 1e-30)
    assert error <= bound, f"max abs error {error:.3g} > {bound:.3g} ({dtype})"


def _with_style(rope: RotaryEmbedding, style: str) -> RotaryEmbedding:
    return RotaryEmbedding(rope.inv_freq, rope.head_size, style=style, attention_scaling=rope.attention_scaling)


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(CASES), head_dim=st.sampled_from(HEAD_DIMS), heads=st.integers(1, 8),
       dtype=st.sampled_from(DTYPES), positions=positions_lists, seed=st.integers(0, 2**32 - 1))
def test_a_matches_transformers(case, head_dim, heads, dtype, positions, seed):
    config = case.config(head_dim)
    pos = torch.tensor(positions)
    x = _random(seed, (len(positions), heads, head_dim), dtype)
    rope = RotaryEmbedding.from_hf_config(config, seq_len=max(positions) + 1)  # as transformers at run time
    expected = case.hf_rotate(config, x.float(), pos).to(dtype)
    _assert_close(rope.rotate(x, pos), expected, dtype)


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(CASES), head_dim=st.sampled_from(HEAD_DIMS), heads=st.integers(1, 8),
       dtype=st.sampled_from(DTYPES), style=st.sampled_from(["neox", "gptj"]),
       pairs=st.lists(st.tuples(st.integers(0, MAX_POSITION), st.integers(0, MAX_POSITION)), min_size=1, max_size=16),
       seed=st.integers(0, 2**32 - 1))
def test_b_scores_depend_only_on_distance(case, head_dim, heads, dtype, style, pairs, seed):
    """Over the rotary dims (pass-through dims are not scaled): <R_a q, R_b k> = <q, R_{b-a} k> * s^2."""
    rope = _with_style(RotaryEmbedding.from_hf_config(case.config(head_dim)), style)
    a, b = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
    q = _random(seed, (len(pairs), heads, head_dim), dtype)
    k = _random(seed + 1, (len(pairs), heads, head_dim), dtype)
    r, s = rope.rotary_dim, rope.attention_scaling

    def dot(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (u[..., :r].double() * v[..., :r].double()).sum(-1)

    lhs = dot(rope.rotate(q, a), rope.rotate(k, b))
    rhs = dot(q, rope.rotate(k, b - a)) * s  # rotate already scales k once
    angle_error = ANGLE_ROUNDING * (a.abs() + b.abs() + (b - a).abs()).double() * rope.inv_freq.max().item()
    norms = q[..., :r].double().norm(dim=-1) * k[..., :r].double().norm(dim=-1) * s**2
    bound = norms * (TOLERANCE[dtype] + angle_error[:, None])
    assert ((lhs - rhs).abs() <= bound).all(), f"max excess {((lhs - rhs).abs() - bound).max():.3g}"


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(CASES), head_dim=st.sampled_from(HEAD_DIMS), heads=st.integers(1, 8),
       dtype=st.sampled_from(DTYPES), style=st.sampled_from(["neox", "gptj"]),
       moves=st.lists(st.tuples(st.integers(0, MAX_POSITION), st.integers(-MAX_POSITION, MAX_POSITION))
                      .map(lambda m: (m[0], min(max(m[0] + m[1], 0), MAX_POSITION))), min_size=1, max_size=16),
       seed=st.integers(0, 2**32 - 1))
def test_c_relocation_equals_rotation_at_destination(case, head_dim, heads, dtype, style, moves, seed):
    rope = _with_style(RotaryEmbedding.from_hf_config(case.config(head_dim)), style)
    src, dst = torch.tensor([m[0] for m in moves]), torch.tensor([m[1] for m in moves])
    x = _random(seed, (len(moves), heads, head_dim), dtype)
    at_src = rope.rotate(x, src)
    relocated = rope.relocate(at_src, src, dst)
    _assert_close(relocated, rope.rotate(x, dst), dtype)
    _assert_close(relocated, rope.rotate(rope.inverse(at_src, src), dst), dtype)


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(CASES), head_dim=st.sampled_from(HEAD_DIMS), heads=st.integers(1, 8),
       dtype=st.sampled_from(DTYPES), style=st.sampled_from(["neox", "gptj"]), positions=positions_lists,
       seed=st.integers(0, 2**32 - 1))
def test_d_inverse_undoes_rotate(case, head_dim, heads, dtype, style, positions, seed):
    rope = _with_style(RotaryEmbedding.from_hf_config(case.config(head_dim)), style)
    pos = torch.tensor(positions)
    x = _random(seed, (len(positions), heads, head_dim), dtype)
    _assert_close(rope.inverse(rope.rotate(x, pos), pos), x, dtype)


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(CASES), head_dim=st.sampled_from(HEAD_DIMS), style=st.sampled_from(["neox", "gptj"]),
       positions=positions_lists, seed=st.integers(0, 2**32 - 1))
def test_both_styles_match_a_complex_number_reference(case, head_dim, style, positions, seed):
    """Each rotary pair, read as a complex number, is multiplied by s * e^{i p theta} (float64 reference)."""
    rope = _with_style(RotaryEmbedding.from_hf_config(case.config(head_dim)), style)
    pos = torch.tensor(positions)
    x = _random(seed, (len(positions), 3, head_dim), torch.float32)
    r = rope.rotary_dim
    rot = x[..., :r].double()
    real, imag = (rot[..., : r // 2], rot[..., r // 2 :]) if style == "neox" else (rot[..., 0::2], rot[..., 1::2])
    angles = pos.double()[:, None] * rope.inv_freq.double()[None, :]
    z = torch.complex(real, imag) * torch.polar(torch.full_like(angles, rope.attention_scaling), angles)[:, None, :]
    pairs = (z.real, z.imag)
    rotated = torch.cat(pairs, -1) if style == "neox" else torch.stack(pairs, -1).flatten(-2)
    expected = torch.cat((rotated, x[..., r:].double()), -1)
    # our angles are float32-rounded products: allow that rounding on top of the float32 tolerance
    slack = TOLERANCE[torch.float32] + ANGLE_ROUNDING * max(positions) * rope.inv_freq.max().item()
    error = (rope.rotate(x, pos).double() - expected).abs().max().item()
    assert error <= slack * rope.attention_scaling * expected.abs().max().item()


#: where a range starts: inside the first table (1,024 positions), across its end, further (the
#: table is as long as the farthest range: the far ends are in the test of its growth below)
range_starts = st.one_of(st.integers(0, 1023), st.integers(960, 1100), st.integers(0, 1 << 14))


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(CASES), head_dim=st.sampled_from(HEAD_DIMS), heads=st.integers(1, 4),
       layers=st.integers(0, 2), dtype=st.sampled_from(DTYPES), style=st.sampled_from(["neox", "gptj"]),
       ranges=st.lists(st.tuples(range_starts, st.integers(1, 48)), min_size=1, max_size=4),
       seed=st.integers(0, 2**32 - 1))
def test_e_rotate_range_is_rotate_at_consecutive_positions_bit_for_bit(case, head_dim, heads, layers, dtype,
                                                                      style, ranges, seed):
    """One embedding for all the ranges, so its table is built by the first and grown by those
    that end past it; ``layers`` 0 is keys ``[T, H, D]``, else all layers ``[L, T, H, D]``."""
    rope = _with_style(RotaryEmbedding.from_hf_config(case.config(head_dim)), style)
    for i, (start, length) in enumerate(ranges):
        x = _random(seed + i, (layers, length, heads, head_dim)[0 if layers else 1:], dtype)
        got = rope.rotate_range(x, start)
        assert got.dtype == torch.float32
        assert torch.equal(got, rope.rotate(x.float(), torch.arange(start, start + length))), (start, length)


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_the_rotation_table_grows_past_1024_positions_with_the_same_rows(style):
    """Built for 1,024 positions, doubled when a range ends past them: every row is the model's
    cos/sin at its position (``[cos, cos]`` and ``[-sin, sin]`` per pair), before and after."""
    rope = _with_style(RotaryEmbedding.from_hf_config(CASES[3].config(64)), style)  # qwen3
    cpu = torch.device("cpu")
    x = _random(1, (3, 2, 64), torch.float32)
    for start, rows in ((0, 1024), (1021, 1024), (1022, 2048), (2046, 4096), (MAX_POSITION, 2 * MAX_POSITION)):
        rotated = rope.rotate_range(x, start)
        cos, sin = rope.table(cpu, 1)  # the table as it is now
        assert cos.shape == sin.shape == (rows, rope.rotary_dim)
        unit_cos, unit_sin = rope.cos_sin(torch.arange(rows))
        pairs = (lambda a, b: torch.cat((a, b), -1)) if style == "neox" else \
            (lambda a, b: torch.stack((a, b), -1).flatten(-2))
        assert torch.equal(cos, pairs(unit_cos, unit_cos)) and torch.equal(sin, pairs(-unit_sin, unit_sin))
        assert torch.equal(rotated, rope.rotate(x, torch.arange(start, start + 3)))


def test_partial_rotary_passes_the_rest_through():
    config = _phi3(80, 0.5, None)
    rope = RotaryEmbedding.from_hf_config(config)
    assert (rope.head_size, rope.rotary_dim) == (80, 40)
    pos = torch.tensor([0, 7, 4096, MAX_POSITION])
    for dtype in DTYPES:
        x = _random(0, (4, 3, 80), dtype)
        for out in (rope.rotate(x, pos), rope.inverse(x, pos), rope.relocate(x, pos, pos.flip(0))):
            assert out.dtype == dtype
            assert torch.equal(out[..., 40:], x[..., 40:])
        assert not torch.equal(rope.rotate(x, pos)[1:, :, :40], x[1:, :, :40])


def test_gptj_matches_gptj_own_rotary():
    config = GPTJConfig(n_embd=128, n_head=2, rotary_dim=32, n_layer=1, vocab_size=128)
    rope = RotaryEmbedding.from_hf_config(config)
    assert (rope.style, rope.head_size, rope.rotary_dim) == ("gptj", 64, 32)
    pos = torch.tensor([0, 1, 2047, 5000, 77777, MAX_POSITION])
    x = _random(0, (len(pos), 2, 64), torch.float32)
    sincos = modeling_gptj.create_sinusoidal_positions(MAX_POSITION + 1, 32)[pos][None]  # [1, T, 32]
    sin, cos = sincos.split(16, dim=-1)
    rotated = modeling_gptj.apply_rotary_pos_emb(x[None, ..., :32], sin, cos)[0]  # GPT-J rotates [B, T, H, D]
    _assert_close(rope.rotate(x, pos), torch.cat((rotated, x[..., 32:]), -1), torch.float32)


def test_unknown_rope_type_is_a_config_error():
    config = LlamaConfig(**_sizes(64))
    config.rope_parameters = {"rope_type": "spiral", "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match=r"'spiral'.*default, dynamic, linear, llama3, longrope, yarn"):
        RotaryEmbedding.from_hf_config(config)


def test_all_layers_at_once():
    """[L, T, H, D] rotates like each layer [T, H, D] on its own."""
    rope = RotaryEmbedding.from_hf_config(CASES[0].config(64))
    x = _random(0, (3, 5, 2, 64), torch.float32)
    src, dst = torch.tensor([0, 9, 100, 8191, 131072]), torch.tensor([5, 5, 5, 0, 65536])
    for method, args in ((rope.rotate, (src,)), (rope.inverse, (src,)), (rope.relocate, (src, dst))):
        assert torch.equal(method(x, *args), torch.stack([method(layer, *args) for layer in x]))


def test_transformers_4_config_layout():
    """Configs that keep rope_theta / rope_scaling as attributes (transformers 4.x) read the same."""
    new = CASES[2].config(64)  # qwen2.5-yarn
    old = SimpleNamespace(hidden_size=128, num_attention_heads=2, max_position_embeddings=MAX_POSITION,
                          rope_theta=1e6, rope_scaling=dict(QWEN25_YARN))
    for a, b in ((new, old), (CASES[1].config(64), SimpleNamespace(**{**vars(old), "rope_scaling": None}))):
        ra, rb = RotaryEmbedding.from_hf_config(a), RotaryEmbedding.from_hf_config(b)
        assert torch.equal(ra.inv_freq, rb.inv_freq) and ra.attention_scaling == rb.attention_scaling


def test_dynamic_ntk_seq_len():
    """None: unscaled (within max_position_embeddings); max * factor: vLLM's precomputed table."""
    config = CASES[6].config(128)  # dynamic, factor 4, max 8192
    plain = RotaryEmbedding.from_hf_config(LlamaConfig(**_sizes(128), head_dim=128))
    assert torch.equal(RotaryEmbedding.from_hf_config(config).inv_freq, plain.inv_freq)
    assert torch.equal(RotaryEmbedding.from_hf_config(config, seq_len=8192).inv_freq, plain.inv_freq)
    vllm_theta = 10000.0 * (4.0 * 4.0 - 3.0) ** (128 / 126)  # vLLM: max_len = 8192 * 4
    vllm = 1.0 / vllm_theta ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    ours = RotaryEmbedding.from_hf_config(config, seq_len=8192 * 4).inv_freq
    torch.testing.assert_close(ours.double(), vllm, rtol=1e-6, atol=0)


def test_bad_inputs_are_rejected():
    rope = RotaryEmbedding.from_hf_config(CASES[1].config(64))
    with pytest.raises(ModelMismatchError):
        rope.rotate(torch.zeros(2, 1, 32), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="integers"):
        rope.rotate(torch.zeros(2, 1, 64), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="T=2"):
        rope.rotate(torch.zeros(2, 1, 64), torch.tensor([0, 1, 2]))
    assert math.isclose(RotaryEmbedding.from_hf_config(CASES[2].config(64)).attention_scaling,
                        0.1 * math.log(4.0) + 1.0)
