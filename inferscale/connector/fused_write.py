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

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
    device, ``[2, layers]``: keys' row 0, values' row 1) and the strides (elements) shared by
    all layers' views."""

    bases: torch.Tensor
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
        bases = torch.tensor([[k.data_ptr() for k, _ in views], [v.data_ptr() for _, v in views]],
                             dtype=torch.int64, device=key.device)
        _, block_size, num_heads, head_size = key.shape
        return cls(bases, strides, block_size, num_heads, head_size, key.dtype)

    @property
    def num_layers(self) -> int:
        return self.bases.shape[1]


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

    @property
    def num_tokens(self) -> int:
        return self.table.shape[1]

    def to(self, device: torch.device) -> Sources:
        """On ``device``: one asynchronous copy of the table, no host sync. (From pageable memory:
        CUDA stages the few kilobytes before the call returns, so the table may be freed at once;
        pinning it first cost more host time than the copy.)"""
        table = self.table.to(device, non_blocking=True) if device.type == "cuda" else self.table
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


#: runtime arguments are never specialized on their values or alignment, so one compiled kernel
#: serves every launch with the same compile-time constants (see :func:`_launch`)
_RUNTIME_ARGS = ["table", "num_tokens", "bases", "cos", "sin", "start", "first_fact", "key_scale", "head0"]

if triton is not None:

    @triton.jit(do_not_specialize=_RUNTIME_ARGS, do_not_specialize_on_alignment=_RUNTIME_ARGS)
    def _write_kernel(table, num_tokens, bases, cos, sin, start, first_fact, key_scale, head0,
                      S_BLOCK: tl.constexpr, S_SLOT: tl.constexpr, S_HEAD: tl.constexpr, S_DIM: tl.constexpr,
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
        # the sources table: rows k_addr, v_addr, layer_stride, slot (Sources)
        step = tl.load(table + 2 * num_tokens + token) * layer
        src_off = step + (head0 + head) * HEAD_SIZE
        k_row = tl.load(table + token).to(tl.pointer_type(SRC))
        v_row = tl.load(table + num_tokens + token).to(tl.pointer_type(SRC))
        x = tl.load(k_row + src_off + dim, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(k_row + src_off + partner, mask=mask, other=0.0).to(tl.float32)
        value = tl.load(v_row + src_off + dim, mask=mask, other=0.0)
        position = start + token
        rotary = dim < ROTARY
        c = tl.load(cos + position * ROTARY + dim, mask=mask & rotary, other=1.0)
        s = tl.load(sin + position * ROTARY + dim, mask=mask & rotary, other=0.0)
        key = x * c + y * s
        key = tl.where(token >= first_fact, key * key_scale, key)
        slot = tl.load(table + 3 * num_tokens + token)
        dst = (slot // BLOCK_SIZE) * S_BLOCK + (slot % BLOCK_SIZE) * S_SLOT + head * S_HEAD + dim * S_DIM
        k_out = tl.load(bases + layer).to(tl.pointer_type(DST))
        v_out = tl.load(bases + tl.num_programs(1) + layer).to(tl.pointer_type(DST))
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
    num_tokens = sources.num_tokens
    if num_tokens == 0:
        return
    constants = (*cache.strides, _TL_DTYPES[sources.dtype], _TL_DTYPES[cache.dtype], cache.block_size,
                 cache.num_heads, cache.head_size, rotary_dim, neox,
                 triton.next_power_of_2(cache.num_heads * cache.head_size))
    _launch((num_tokens, cache.num_layers), (sources.table, num_tokens, cache.bases, cos, sin, start, first_fact,
                                             float(key_scale), head0), constants)


#: Triton releases whose compiled kernels :func:`_launch` calls directly (their launcher takes
#: every parameter, compile-time constants included, in signature order)
_DIRECT_LAUNCH_RELEASES = {"3.6"}
#: (device, compile-time constants) -> the compiled kernel
_compiled: dict[tuple, Any] = {}
_INT32 = 1 << 31


def _launch(grid: tuple[int, int], args: tuple, constants: tuple) -> None:
    """Launch the kernel. The first launch with given compile-time constants goes through
    Triton's JIT (which compiles, or finds the kernel in its cache); later ones call the
    compiled kernel directly, which skips the JIT's per-launch argument binding: a tenth of a
    millisecond of host time on the request's critical path. Safe because no runtime argument
    is specialized (their value types are fixed: pointers, int32, float32)."""
    table = args[0]
    key = (table.device.index, constants)
    kernel = _compiled.get(key)
    if kernel is not None and all(abs(a) < _INT32 for a in args[1:] if isinstance(a, int)):
        # the compiled kernel's runner reads all three grid dimensions
        kernel[(*grid, 1)](*args, *constants, stream=torch.cuda.current_stream(table.device).cuda_stream)
        return
    names = ("S_BLOCK", "S_SLOT", "S_HEAD", "S_DIM", "SRC", "DST", "BLOCK_SIZE", "HEADS", "HEAD_SIZE", "ROTARY",
             "NEOX", "WIDTH")
    compiled = _write_kernel[grid](*args, **dict(zip(names, constants)))
    if _direct_launch_supported() and hasattr(compiled, "packed_metadata") and table.is_cuda:
        _compiled[key] = compiled


def _direct_launch_supported() -> bool:
    return ".".join(triton.__version__.split(".")[:2]) in _DIRECT_LAUNCH_RELEASES and not _interpreted()


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
