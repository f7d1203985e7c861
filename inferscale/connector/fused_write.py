"""One kernel launch writes a request's memory into vLLM's paged cache.

For every layer, token and KV head of this rank, the kernel reads the fact's
stored pre-RoPE key and its value straight from where the store holds them
(the facts' own blocks: no gather, no temporary copies), rotates the key to
its position with the model's cos/sin table, scales the facts' keys, casts to
the cache dtype and stores both at the token's cache slot. What the loop of
whole-tensor ops (:meth:`SegmentLoader.load` + one backend write per layer)
does in ~10 launches per layer and several full passes over the K/V, this
does in one launch and one pass.

Sources are given per token as raw addresses (:func:`token_sources`), so a
fact's block can live in GPU memory or, under unified addressing, in pinned
host memory. The destination is described by :class:`CacheViews`: the
backend's own K and V views of each layer's cache (``[num_blocks,
block_size, heads, head_size]`` with any strides; :func:`compat.kv_cache_views`).

The arithmetic matches :meth:`RotaryEmbedding.rotate_range`: float32
``x * cos + partner(x) * sin`` from the same table, then one cast (the
compiler may fuse the multiply-add, a difference of at most one float32
rounding before the cast to the cache dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inferscale.storage.blocks import HeldBlocks

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU builds): the per-layer path is used
    triton = None

_TL_DTYPES = {}
if triton is not None:
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def available() -> bool:
    return triton is not None


@dataclass(frozen=True)
class CacheViews:
    """Every layer's K and V cache as the kernel addresses them: base pointers (int64 on the
    device) and the strides (elements) shared by all layers' views."""

    k_bases: torch.Tensor
    v_bases: torch.Tensor
    strides: tuple[int, int, int, int]  # block, slot in block, head, dim
    block_size: int
    num_heads: int
    head_size: int
    dtype: torch.dtype

    @classmethod
    def of(cls, views: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> CacheViews:
        key, value = views[0]
        strides = tuple(key.stride())
        for k, v in views:
            if tuple(k.stride()) != strides or tuple(v.stride()) != strides or k.shape != key.shape \
                    or k.dtype != key.dtype or v.dtype != key.dtype:
                raise ValueError("the layers' cache views differ in shape, strides or dtype")
        device = key.device
        k_bases = torch.tensor([k.data_ptr() for k, _ in views], dtype=torch.int64, device=device)
        v_bases = torch.tensor([v.data_ptr() for _, v in views], dtype=torch.int64, device=device)
        _, block_size, num_heads, head_size = key.shape
        return cls(k_bases, v_bases, strides, block_size, num_heads, head_size, key.dtype)


@dataclass(frozen=True)
class Sources:
    """Where each token's K/V lies and where it goes, packed in one int64 ``table`` so that it
    reaches the device in one copy: row 0 the address of the token's layer-0 key row, row 1
    of its value row, row 2 the distance (elements) from one layer's row to the next, row 3
    its cache slot; and the blocks the addresses point into (kept alive by the caller until
    the kernel has run)."""

    table: torch.Tensor
    dtype: torch.dtype
    num_heads: int
    blocks: tuple[torch.Tensor, ...]

    @property
    def k_addr(self) -> torch.Tensor:
        return self.table[0]

    @property
    def v_addr(self) -> torch.Tensor:
        return self.table[1]

    @property
    def layer_stride(self) -> torch.Tensor:
        return self.table[2]

    @property
    def slots(self) -> torch.Tensor:
        return self.table[3]

    def to(self, device: torch.device) -> Sources:
        """On ``device``: one pinned, asynchronous copy of the table (no host sync)."""
        table = self.table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else self.table
        return Sources(table, self.dtype, self.num_heads, self.blocks)


def token_sources(held: HeldBlocks, start: int, end: int, slots: Sequence[int]) -> Sources:
    """Sources of tokens ``start..end-1`` of the concatenation of ``held``'s blocks, to be
    written to cache ``slots`` (one per token).

    The per-token arithmetic runs in NumPy over the blocks' addresses and lengths: on a few
    thousand tokens it costs microseconds, where the same dozen small torch ops cost a tenth
    of a millisecond of host time on the request's critical path."""
    if len(slots) != end - start:
        raise ValueError(f"{len(slots)} slots for {end - start} tokens")
    layout, lengths = held.layout, held.lengths
    row = layout.num_kv_heads * layout.head_size
    which = np.repeat(np.arange(len(lengths)), lengths)[start:end]
    offsets = np.cumsum(lengths) - lengths
    size = layout.dtype.itemsize
    table = np.empty((4, len(which)), dtype=np.int64)
    table[2] = lengths[which] * row  # layer stride
    table[0] = held.addresses[which] + (np.arange(start, end, dtype=np.int64) - offsets[which]) * row * size
    table[1] = table[0] + layout.num_layers * table[2] * size
    table[3] = slots
    return Sources(torch.from_numpy(table), layout.dtype, layout.num_kv_heads, held.blocks)


if triton is not None:

    @triton.jit
    def _write_kernel(k_addr, v_addr, layer_stride, slots, k_bases, v_bases, cos, sin,
                      start, first_fact, key_scale, head0,
                      s_block, s_slot, s_head, s_dim,
                      SRC: tl.constexpr, DST: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, ROTARY: tl.constexpr,
                      NEOX: tl.constexpr, WIDTH: tl.constexpr):
        token = tl.program_id(0)
        layer = tl.program_id(1)
        i = tl.arange(0, WIDTH)
        mask = i < HEADS * HEAD_SIZE
        head = i // HEAD_SIZE
        dim = i % HEAD_SIZE
        if NEOX:
            partner = tl.where(dim < ROTARY, (dim + ROTARY // 2) % ROTARY, dim)
        else:
            partner = tl.where(dim < ROTARY, dim ^ 1, dim)
        step = tl.load(layer_stride + token) * layer
        src_off = step + (head0 + head) * HEAD_SIZE
        k_row = tl.load(k_addr + token).to(tl.pointer_type(SRC))
        v_row = tl.load(v_addr + token).to(tl.pointer_type(SRC))
        x = tl.load(k_row + src_off + dim, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(k_row + src_off + partner, mask=mask, other=0.0).to(tl.float32)
        value = tl.load(v_row + src_off + dim, mask=mask, other=0.0)
        position = start + token
        rotary = dim < ROTARY
        c = tl.load(cos + position * ROTARY + dim, mask=mask & rotary, other=1.0)
        s = tl.load(sin + position * ROTARY + dim, mask=mask & rotary, other=0.0)
        key = x * c + y * s
        key = tl.where(token >= first_fact, key * key_scale, key)
        slot = tl.load(slots + token)
        dst = (slot // BLOCK_SIZE) * s_block + (slot % BLOCK_SIZE) * s_slot + head * s_head + dim * s_dim
        k_out = tl.load(k_bases + layer).to(tl.pointer_type(DST))
        v_out = tl.load(v_bases + layer).to(tl.pointer_type(DST))
        tl.store(k_out + dst, key.to(DST), mask=mask)
        tl.store(v_out + dst, value.to(DST), mask=mask)


def write_segment(cache: CacheViews, sources: Sources, cos: torch.Tensor, sin: torch.Tensor,
                  start: int, head0: int, rotary_dim: int, neox: bool, key_scale: float = 1.0,
                  first_fact: int = 0) -> None:
    """Write tokens ``start..`` (those of ``sources``, on the cache's device) to their slots
    into every layer of the cache; ``cos``/``sin`` are the ``[positions, rotary_dim]`` float32
    table of :meth:`RotaryEmbedding.table`; keys of tokens from ``first_fact`` on (relative
    to ``start``) are multiplied by ``key_scale``."""
    if triton is None:
        raise RuntimeError("the fused cache write needs Triton")
    num_tokens, num_layers = sources.table.shape[1], len(cache.k_bases)
    if num_tokens == 0:
        return
    width = triton.next_power_of_2(cache.num_heads * cache.head_size)
    _write_kernel[(num_tokens, num_layers)](
        sources.k_addr, sources.v_addr, sources.layer_stride, sources.slots, cache.k_bases, cache.v_bases, cos, sin,
        start, first_fact, float(key_scale), head0, *cache.strides,
        SRC=_TL_DTYPES[sources.dtype], DST=_TL_DTYPES[cache.dtype], BLOCK_SIZE=cache.block_size,
        HEADS=cache.num_heads, HEAD_SIZE=cache.head_size, ROTARY=rotary_dim, NEOX=neox, WIDTH=width,
    )
