"""Where a layer's K and V live in the paged cache tensor vLLM registered, checked before use.

vLLM picks the cache layout (its attention backend, its release, a layout setting) and
hands the connector one tensor per layer, often a strided view into a buffer shared by
every layer. A :class:`CacheLayout` says how K and V lie in such a tensor: which
arrangement, the block size, the KV heads and head size, the tensor's shape and strides;
:meth:`CacheLayout.views` gives the K and V views ``[num_blocks, block_size, kv_heads,
head_size]`` that both write paths address (the per-layer write indexes them, the fused
kernel takes their strides). Views only: nothing is copied, whatever the strides.

The tensor's shape allows a few arrangements; which one the backend uses is settled by a
self-test at engine start (:func:`identify`): the backend's own cache-write op writes one
block (vLLM's null block, restored afterwards) and the arrangement whose views read back
exactly what it wrote is the layout. A tensor no arrangement fits, or a read-back that no
arrangement reproduces, raises :class:`LayoutError`: the connector then injects nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

#: how K and V are arranged in a layer's cache tensor (see :func:`_views`)
KV_LAST = "kv-last"  # [blocks, heads, slots, 2 * head_size]: a slot's K then V in the last dim (FlashAttention)
KV_HALVES = "kv-halves"  # the same shape; a head's block holds all its keys, then all its values
KV_HALVES_DIM_MAJOR = "kv-halves-dim-major"  # the same, keys stored dim by dim (vectorized CPU kernels)
KV_PLANES = "kv-planes"  # five dims, one of size 2 (K, V) before or after the blocks' dim
PACKED = (KV_LAST, KV_HALVES, KV_HALVES_DIM_MAJOR)

#: the backend's own write of ``key, value [tokens, kv_heads, head_size]`` at ``slots`` into one layer's cache
CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class LayoutError(ValueError):
    """A cache layout the connector cannot describe, or one its self-test did not confirm."""


@dataclass(frozen=True)
class CacheLayout:
    """How K and V lie in one layer's paged cache tensor (see the module)."""

    arrangement: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    block_size: int
    num_kv_heads: int
    head_size: int
    #: kv-planes: the dims of K/V, of the blocks, and of the slots and heads (in the tensor's order)
    dims: tuple[int, ...] = ()

    @classmethod
    def from_tensor(cls, cache: torch.Tensor, num_kv_heads: int, head_size: int, arrangement: str) -> CacheLayout:
        """The layout of ``cache`` under ``arrangement``; a LayoutError when its shape does not fit."""
        fitting = [layout for layout in candidates(cache, num_kv_heads, head_size) if layout.arrangement == arrangement]
        if not fitting:
            raise LayoutError(f"a cache of shape {tuple(cache.shape)} is not {arrangement} "
                              f"with {num_kv_heads} KV heads of size {head_size}")
        return fitting[0]

    @property
    def block_dim(self) -> int:
        """The tensor's dim that numbers the blocks."""
        return self.dims[1] if self.arrangement == KV_PLANES else 0

    def describe(self) -> str:
        return (f"{self.arrangement}, block size {self.block_size}, {self.num_kv_heads} KV heads of "
                f"{self.head_size}, shape {self.shape}, strides {self.strides}, {self.dtype}")

    def views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[num_blocks, block_size, kv_heads, head_size]``, views into ``cache``."""
        if tuple(cache.shape) != self.shape or tuple(cache.stride()) != self.strides or cache.dtype != self.dtype:
            raise LayoutError(f"a cache of shape {tuple(cache.shape)}, strides {tuple(cache.stride())}, "
                              f"{cache.dtype} is not the one described ({self.describe()})")
        return _views(self, cache)

    def write(self, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """K/V ``[tokens, kv_heads, head_size]`` into ``cache`` at ``slots`` (block * block_size + offset)."""
        write_views(self.views(cache), key, value, split_slots(slots, cache.device, self.block_size))


def split_slots(slots: torch.Tensor, device: torch.device, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots as (block, offset in the block), on ``device``."""
    slots = slots.to(device, torch.int64)
    return slots // block_size, slots % block_size


def write_views(views: tuple[torch.Tensor, torch.Tensor], key: torch.Tensor, value: torch.Tensor,
                where: tuple[torch.Tensor, torch.Tensor]) -> None:
    """K/V ``[tokens, kv_heads, head_size]`` into a layer's K and V views at (blocks, offsets)."""
    key_view, value_view = views
    key_view[where] = key.to(key_view.dtype)
    value_view[where] = value.to(value_view.dtype)


def candidates(cache: torch.Tensor, num_kv_heads: int, head_size: int) -> list[CacheLayout]:
    """Every arrangement the tensor's shape allows, for these heads and head size."""
    shape, strides = tuple(cache.shape), tuple(cache.stride())

    def layout(arrangement: str, block_size: int, dims: tuple[int, ...] = ()) -> CacheLayout:
        return CacheLayout(arrangement, shape, strides, cache.dtype, block_size, num_kv_heads, head_size, dims)

    if len(shape) == 4 and shape[1] == num_kv_heads and shape[3] == 2 * head_size:
        return [layout(arrangement, shape[2]) for arrangement in PACKED]
    if len(shape) != 5 or shape[4] != head_size:
        return []
    found = []
    for kv, blocks in ((0, 1), (1, 0)):
        if shape[kv] != 2:
            continue
        for slots, heads in ((2, 3), (3, 2)):
            if shape[heads] == num_kv_heads:
                found.append(layout(KV_PLANES, shape[slots], (kv, blocks, slots, heads)))
    return found


def _views(layout: CacheLayout, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The arrangement's K and V views (``.view`` never copies: a tensor whose strides do
    not allow one raises, and that arrangement does not fit)."""
    blocks, size, heads, dim = layout.shape[layout.block_dim], layout.block_size, layout.num_kv_heads, layout.head_size
    try:
        if layout.arrangement == KV_LAST:
            key, value = cache.transpose(1, 2).split(dim, dim=-1)
        elif layout.arrangement == KV_HALVES:
            halves = cache.view(blocks, heads, 2, size, dim)
            key, value = halves[:, :, 0].transpose(1, 2), halves[:, :, 1].transpose(1, 2)
        elif layout.arrangement == KV_HALVES_DIM_MAJOR:
            halves = cache.view(blocks, heads, 2, size * dim)
            key = halves[:, :, 0].view(blocks, heads, dim, size).permute(0, 3, 1, 2)
            value = halves[:, :, 1].view(blocks, heads, size, dim).transpose(1, 2)
        elif layout.arrangement == KV_PLANES:
            kv, block_dim, slots, head_dims = layout.dims
            order = [block_dim, slots, head_dims, 4]
            key, value = (cache.select(kv, i).permute(*[d - (d > kv) for d in order]) for i in (0, 1))
        else:
            raise LayoutError(f"unknown arrangement {layout.arrangement!r}")
    except RuntimeError as exc:  # a view the strides do not allow
        raise LayoutError(f"{layout.arrangement} does not fit strides {layout.strides}: {exc}") from None
    return key, value


def identify(cache: torch.Tensor, backend_write: CacheWrite | None, num_kv_heads: int, head_size: int,
             block: int = 0) -> CacheLayout:
    """The layout of ``cache``: the arrangement whose views read back exactly what the
    backend's own write put into ``block`` (its old contents restored afterwards).
    A LayoutError says why none is confirmed."""
    found = candidates(cache, num_kv_heads, head_size)
    if not found:
        raise LayoutError(f"a cache of shape {tuple(cache.shape)}, strides {tuple(cache.stride())} fits no "
                          f"known arrangement of {num_kv_heads} KV heads of size {head_size}")
    if backend_write is None:
        raise LayoutError("the attention backend has no cache-write op to check the layout against")
    first = found[0]
    saved = cache.select(first.block_dim, block).clone()
    try:
        key, value = _pattern(first, cache.device)
        slots = torch.arange(block * first.block_size, (block + 1) * first.block_size, device=cache.device)
        backend_write(key, value, slots)
        for layout in found:
            if _reads_back(layout, cache, block, key, value):
                return layout
    except LayoutError:
        raise
    except Exception as exc:  # the backend's op refused these inputs: nothing is known
        raise LayoutError(f"the backend's cache write failed in the self-test ({type(exc).__name__}: {exc})") from None
    finally:
        cache.select(first.block_dim, block).copy_(saved)
    raise LayoutError(f"no arrangement of a cache of shape {tuple(cache.shape)}, strides {tuple(cache.stride())} "
                      f"reads back what the backend wrote (tried {', '.join(l.arrangement for l in found)})")


def _pattern(layout: CacheLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A block of distinct random K and V, ``[block_size, kv_heads, head_size]`` in the cache dtype."""
    gen = torch.Generator().manual_seed(20261201)
    shape = (layout.block_size, layout.num_kv_heads, layout.head_size)
    key, value = (torch.randn(shape, generator=gen).to(layout.dtype).to(device) for _ in range(2))
    return key, value


def _reads_back(layout: CacheLayout, cache: torch.Tensor, block: int, key: torch.Tensor, value: torch.Tensor) -> bool:
    try:
        key_view, value_view = layout.views(cache)
    except LayoutError:
        return False
    return torch.equal(key_view[block], key) and torch.equal(value_view[block], value)


class PagedLayers:
    """Every decoder layer's cache tensor with its confirmed layout (a
    :class:`~inferscale.inject.writer.PagedCache`): K/V are written through the layout's views."""

    def __init__(self, caches: Sequence[torch.Tensor], layouts: Sequence[CacheLayout]):
        self.caches, self.layouts = list(caches), list(layouts)
        # the caches stay put for the engine's life: their views, checked once
        self._views = [layout.views(cache) for cache, layout in zip(self.caches, self.layouts, strict=True)]

    @classmethod
    def check(cls, caches: Sequence[torch.Tensor], backend_writes: Sequence[CacheWrite | None], num_kv_heads: int,
              head_size: int) -> PagedLayers:
        """Each layer's layout confirmed by the self-test (:func:`identify`); a LayoutError names
        the first layer that failed and why."""
        layouts = []
        for index, (cache, write) in enumerate(zip(caches, backend_writes, strict=True)):
            try:
                layouts.append(identify(cache, write, num_kv_heads, head_size))
            except LayoutError as exc:
                raise LayoutError(f"layer {index}: {exc}") from None
        return cls(caches, layouts)

    def views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's K and V views, for the fused write (a LayoutError: not on this device)."""
        if self.caches[0].device.type != "cuda":
            raise LayoutError(f"the caches are on {self.caches[0].device.type} (the fused write runs on CUDA)")
        return list(self._views)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        where = split_slots(slots, self.caches[layer].device, self.layouts[layer].block_size)
        write_views(self._views[layer], key, value, where)
