"""Chunked RoPE: rotary position embeddings applied to stored pre-RoPE keys.

InferScale stores every fact's keys *before* RoPE and rotates them at whatever
positions the fact lands on. Because ``R_a^T R_b = R_{b-a}``, this placement is
exact: attention scores depend only on the query/key position difference.

:class:`RotaryEmbedding` is built from a Hugging Face config and reproduces the
model's own rotary embedding: the same ``inv_freq`` (default, linear, dynamic
NTK, llama3, yarn, longrope), the same attention scaling folded into cos/sin,
and the same float32 angle arithmetic (``float(position) * inv_freq``) that
transformers and vLLM use, so rotated keys equal the keys the model itself
would have produced at those positions.

The inverse frequencies of each RoPE type are in :mod:`inferscale.compose.rope_types`.

Layout: ``x`` is ``[..., T, H, D]`` (keys ``[T, H, D]``, all layers
``[L, T, H, D]``); ``positions`` is an integer tensor ``[T]``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from inferscale.compose.rope_types import DEFAULT_THETA, INV_FREQ_FNS, InvFreqFn, rope_parameters
from inferscale.errors import ConfigError, ModelMismatchError

__all__ = ["DEFAULT_THETA", "INV_FREQ_FNS", "InvFreqFn", "RotaryEmbedding", "Style", "rope_parameters"]

Style = Literal["neox", "gptj"]

# Models whose rotary embedding rotates interleaved pairs (transformers' ``rotate_every_two``);
# their configs give ``rotary_dim`` and no rope parameters.
_INTERLEAVED_MODEL_TYPES = frozenset({"gptj", "codegen"})


class RotaryEmbedding:
    """A model's rotary embedding, applicable at arbitrary per-token positions.

    Only the first ``rotary_dim`` dims of each head rotate (partial rotary);
    the rest pass through unchanged. All math is float32 on ``x``'s device and
    the result has ``x``'s dtype.
    """

    def __init__(
        self,
        inv_freq: torch.Tensor,
        head_size: int,
        *,
        style: Style = "neox",
        attention_scaling: float = 1.0,
    ):
        rotary_dim = 2 * inv_freq.numel()
        if inv_freq.dim() != 1 or rotary_dim == 0 or rotary_dim > head_size:
            raise ConfigError(f"inv_freq must be 1-D with 1..{head_size // 2} entries, got {tuple(inv_freq.shape)}")
        if style not in ("neox", "gptj"):
            raise ConfigError(f"RoPE style must be 'neox' or 'gptj', got {style!r}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.style: Style = style
        self.attention_scaling = float(attention_scaling)
        self.inv_freq = inv_freq.detach().to(device="cpu", dtype=torch.float32)
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}  # per-device copies (serving hot path)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # see rotate_range

    def __repr__(self) -> str:
        return (
            f"RotaryEmbedding(head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"style={self.style!r}, attention_scaling={self.attention_scaling})"
        )

    @classmethod
    def from_hf_config(cls, config: Any, *, seq_len: int | None = None) -> RotaryEmbedding:
        """The rotary embedding a Hugging Face model with ``config`` uses.

        Reads ``config.rope_parameters`` (transformers >= 5) or the older
        ``config.rope_theta`` / ``config.rope_scaling`` / ``config.partial_rotary_factor``.

        ``seq_len`` only matters for RoPE types whose frequencies depend on the
        sequence length, and follows transformers' semantics:

        * ``dynamic`` (dynamic NTK): ``None`` gives the frequencies the model uses
          for sequences within ``max_position_embeddings`` (i.e. unscaled);
          ``seq_len=n`` gives those transformers uses when the longest position
          in the batch is ``n - 1``. vLLM instead precomputes one table at
          ``max_position_embeddings * factor``: pass
          ``seq_len=int(config.max_position_embeddings * factor)`` to match vLLM.
        * ``longrope``: ``None`` (or ``seq_len <= original_max_position_embeddings``)
          gives the short factors, a longer ``seq_len`` the long factors.
        """
        params = rope_parameters(config)
        rope_type = params["rope_type"]
        inv_freq_fn = INV_FREQ_FNS.get(rope_type)
        if inv_freq_fn is None:
            raise ConfigError(f"unsupported rope_type {rope_type!r} — supported: {', '.join(sorted(INV_FREQ_FNS))}")
        head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        style: Style = "gptj" if getattr(config, "model_type", None) in _INTERLEAVED_MODEL_TYPES else "neox"
        if style == "gptj":
            rotary_dim = getattr(config, "rotary_dim", None) or head_size
        else:
            rotary_dim = int(head_size * params.get("partial_rotary_factor", 1.0))
        if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
            raise ConfigError(f"rotary dim {rotary_dim} must be even and within head size {head_size}")
        inv_freq, scaling = inv_freq_fn(params, rotary_dim, config.max_position_embeddings, seq_len)
        return cls(inv_freq, head_size, style=style, attention_scaling=scaling)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``cos`` and ``sin`` ``[T, rotary_dim // 2]`` at ``positions``, times attention_scaling."""
        cos, sin = self._unit_cos_sin(positions)
        return cos * self.attention_scaling, sin * self.attention_scaling

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Apply RoPE: ``x`` as the model sees it at ``positions``."""
        cos, sin = self.cos_sin(self._check(x, positions))
        return self._apply(x, cos, sin)

    def rotate_range(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """:meth:`rotate` at the contiguous positions ``start..start+T-1``, as float32.

        The serving hot path: cos/sin come from a per-device table (built once,
        grown by doubling) and the rotation is a handful of whole-tensor ops, with
        no trigonometry per call. The result is bitwise equal to
        ``rotate(x.float(), arange(start, start+T))``: the table holds the same
        float32 products, and ``x1*cos + x2*(-sin)`` rounds as ``x1*cos - x2*sin``.
        """
        if x.dim() < 3 or x.shape[-1] != self.head_size:
            raise ModelMismatchError(f"expected x of shape [..., T, H, {self.head_size}], got {tuple(x.shape)}")
        if start < 0:
            raise ValueError(f"positions must be non-negative, got start={start}")
        cos, sin = self.table(x.device, start + x.shape[-3])
        cos, sin = cos[start:start + x.shape[-3], None, :], sin[start:start + x.shape[-3], None, :]
        xf = x.to(torch.float32)
        rot = xf[..., : self.rotary_dim]
        out = xf.clone() if self.rotary_dim < self.head_size else torch.empty_like(xf)
        out_rot = out[..., : self.rotary_dim]
        torch.mul(rot, cos, out=out_rot)
        out_rot += self._pair_swap(rot) * sin
        return out

    def inverse(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Undo :meth:`rotate`: rotate by ``-positions`` and divide by attention_scaling."""
        cos, sin = self._unit_cos_sin(self._check(x, positions))
        return self._apply(x, cos / self.attention_scaling, -sin / self.attention_scaling)

    def relocate(self, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """Move already-rotated ``x`` from positions ``src`` to ``dst`` (a rotation by ``dst - src``).

        The rotation angle is ``angle(dst) - angle(src)`` of the model's own
        float32 angles (combined by the angle-difference identities), not
        ``float32((dst - src) * inv_freq)``: at 128k positions a float32 angle
        carries up to ~4e-3 rad of rounding, and relocated keys must land
        exactly where :meth:`rotate` at ``dst`` (and so the model) puts them.
        The result equals ``rotate(inverse(x, src), dst)`` in one pass.
        """
        cos_src, sin_src = self._unit_cos_sin(self._check(x, src))
        cos_dst, sin_dst = self._unit_cos_sin(self._check(x, dst))
        cos = cos_dst * cos_src + sin_dst * sin_src
        sin = sin_dst * cos_src - cos_dst * sin_src
        return self._apply(x, cos, sin)

    def _check(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``positions`` on ``x``'s device, after checking both shapes."""
        if x.dim() < 3 or x.shape[-1] != self.head_size:
            raise ModelMismatchError(f"expected x of shape [..., T, H, {self.head_size}], got {tuple(x.shape)}")
        if positions.dim() != 1 or positions.shape[0] != x.shape[-3]:
            raise ValueError(f"positions must be [T] with T={x.shape[-3]}, got {tuple(positions.shape)}")
        if positions.dtype.is_floating_point or positions.dtype.is_complex:
            raise ValueError(f"positions must be integers, got {positions.dtype}")
        return positions.to(x.device)

    def _unit_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscaled cos/sin, computed exactly as transformers and vLLM do (float32 product)."""
        angles = positions.to(torch.float32)[:, None] * self._inv_freq(positions.device)[None, :]
        return angles.cos(), angles.sin()

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        """``inv_freq`` on ``device``, copied there once."""
        if device not in self._inv_freq_on:
            self._inv_freq_on[device] = self.inv_freq.to(device)
        return self._inv_freq_on[device]

    def table(self, device: torch.device, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position ``[cos, cos]`` and ``[-sin, sin]`` rows over the rotary dims (neox;
        interleaved for gptj), float32, times attention_scaling, for at least ``length`` positions.
        The fused cache write relies on this shape: a pair's cos at both its dims, its sin negated
        at the first."""
        table = self._tables.get(device)
        if table is None or table[0].shape[0] < length:
            size = max(1024, 1 << max(0, length - 1).bit_length())
            cos, sin = self.cos_sin(torch.arange(size, device=device))
            if self.style == "neox":
                table = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
            else:
                table = torch.stack((cos, cos), -1).flatten(-2), torch.stack((-sin, sin), -1).flatten(-2)
            self._tables[device] = table
        return table

    def _pair_swap(self, rot: torch.Tensor) -> torch.Tensor:
        """Each rotary dim's partner: halves swapped (neox) or neighbours swapped (gptj)."""
        if self.style == "neox":
            return rot.roll(self.rotary_dim // 2, dims=-1)
        pairs = rot.unflatten(-1, (self.rotary_dim // 2, 2))
        return pairs.flip(-1).flatten(-2)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate each pair of the rotary dims by (cos, sin) ``[T, rotary_dim // 2]``."""
        xf = x.to(torch.float32)
        rot, rest = xf[..., : self.rotary_dim], xf[..., self.rotary_dim :]
        cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
        if self.style == "neox":
            x1, x2 = rot.chunk(2, dim=-1)
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((rotated, rest), dim=-1).to(x.dtype)
