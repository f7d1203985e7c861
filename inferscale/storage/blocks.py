"""Blocks: how the in-process stores hold a fact's K/V, and how they gather them.

A *block* is one fact's K/V stacked as ``[2, num_layers, num_tokens,
num_kv_heads, head_size]`` (``block[0]`` keys, ``block[1]`` values).
Concatenating blocks along dim 2 gives ``[2, L, T_total, H, D]`` whose ``[0]``
and ``[1]`` are contiguous ``[L, T_total, H, D]`` tensors: a KVBatch's keys and
values, in one allocation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inferscale.kv import FactKV, KVBatch
from inferscale.storage.layout import KVLayout


@dataclass(frozen=True)
class HeldBlocks:
    """Blocks as a reader that addresses them in place sees them (the fused cache write): the
    blocks themselves (whoever holds this keeps them alive), their data pointers and token
    counts (int64 NumPy arrays, one entry per block), and the layout they all share. Every
    block is contiguous."""

    blocks: tuple[torch.Tensor, ...]
    addresses: np.ndarray
    lengths: np.ndarray
    layout: KVLayout

    @classmethod
    def of(cls, blocks: Sequence[torch.Tensor]) -> HeldBlocks:
        """Checked: ``[2, L, T, H, D]`` blocks, contiguous, of one layout, on one device."""
        if not blocks:
            raise ValueError("no blocks")
        first = blocks[0]
        if first.dim() != 5 or first.shape[0] != 2:
            raise ValueError(f"a block is [2, L, T, H, D], got {tuple(first.shape)}")
        for block in blocks:
            if not block.is_contiguous() or block.dtype != first.dtype or block.device != first.device \
                    or block.dim() != 5 or block.shape[:2] != first.shape[:2] or block.shape[3:] != first.shape[3:]:
                raise ValueError("blocks must be contiguous [2, L, T, H, D] of one layout, on one device")
        _, layers, _, heads, size = first.shape
        return cls(tuple(blocks), np.fromiter((b.data_ptr() for b in blocks), np.int64, len(blocks)),
                   np.fromiter((b.shape[2] for b in blocks), np.int64, len(blocks)),
                   KVLayout(int(layers), int(heads), int(size), first.dtype))

    @classmethod
    def empty(cls, layout: KVLayout) -> HeldBlocks:
        none = np.zeros(0, dtype=np.int64)
        return cls((), none, none, layout)

    def __add__(self, other: HeldBlocks) -> HeldBlocks:
        if other.layout != self.layout or (self.blocks and other.blocks
                                           and other.blocks[0].device != self.blocks[0].device):
            raise ValueError(f"blocks of two layouts or devices: {self.layout.describe()} and {other.layout.describe()}")
        return HeldBlocks(self.blocks + other.blocks, np.concatenate((self.addresses, other.addresses)),
                          np.concatenate((self.lengths, other.lengths)), self.layout)

    def select(self, rows: Sequence[int]) -> HeldBlocks:
        """The blocks at ``rows``, in that order."""
        index = np.asarray(rows, dtype=np.int64)
        return HeldBlocks(tuple(self.blocks[i] for i in rows), self.addresses[index], self.lengths[index],
                          self.layout)


def stack_block(kv: FactKV, device: torch.device) -> torch.Tensor:
    """A fresh ``[2, L, T, H, D]`` block on ``device`` (never aliases the caller's tensors)."""
    return torch.stack((kv.keys.detach(), kv.values.detach())).to(device)


def gather_blocks(blocks: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Concatenate blocks along the token axis into a new tensor on ``device``.

    Host blocks bound for a GPU are copied one by one with ``non_blocking=True``
    (from pinned memory each copy is one DMA of a contiguous block, issued while
    earlier ones run) and joined by one ``cat`` on the GPU: stream-ordered, valid
    on the current CUDA stream. Anything else is joined where it lies and then
    moved with a plain (synchronous) ``.to``.
    """
    if blocks[0].device.type == "cpu" and device.type == "cuda":
        parts = move_blocks(blocks, device)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return torch.cat(list(blocks), dim=2).to(device)


def move_blocks(blocks: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Each block on ``device``: host blocks bound for a GPU are copied with ``non_blocking=True``
    (stream-ordered on the current CUDA stream; from pinned memory one DMA per block)."""
    non_blocking = device.type == "cuda"
    return [block.to(device, non_blocking=non_blocking) for block in blocks]


def batch_from_blocks(
    fact_ids: Sequence[str], token_ids: Sequence[tuple[int, ...]], stacked: torch.Tensor
) -> KVBatch:
    """A KVBatch over ``stacked`` (``[2, L, T, H, D]``, contiguous)."""
    return KVBatch(list(fact_ids), list(token_ids), stacked[0], stacked[1])


def empty_batch(layout: KVLayout | None, device: torch.device) -> KVBatch:
    """No facts: ``[L, 0, H, D]`` keys/values when the layout is known, else ``[0, 0, 0, 0]``."""
    if layout is None:
        shape, dtype = (0, 0, 0, 0), torch.float32
    else:
        shape, dtype = layout.block_shape(0)[1:], layout.dtype
    keys = torch.empty(shape, dtype=dtype, device=device)
    return KVBatch([], [], keys, torch.empty_like(keys))
