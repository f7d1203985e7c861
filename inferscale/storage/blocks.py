"""Blocks: how the in-process stores hold a fact's K/V, and how they gather them.

A *block* is one fact's K/V stacked as ``[2, num_layers, num_tokens,
num_kv_heads, head_size]`` (``block[0]`` keys, ``block[1]`` values).
Concatenating blocks along dim 2 gives ``[2, L, T_total, H, D]`` whose ``[0]``
and ``[1]`` are contiguous ``[L, T_total, H, D]`` tensors: a KVBatch's keys and
values, in one allocation. A fact kept in fp8 has an e4m3 block and its *dequant*, its
offsets and scales (``[2, L, H, D + 1]`` bfloat16, :mod:`inferscale.kv_fp8`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inferscale.kv import FactKV, KVBatch
from inferscale.kv_fp8 import DEQUANT_DTYPE, Fp8KV, dequantize_block
from inferscale.storage.layout import KVLayout

_NONE = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class HeldBlocks:
    """Blocks as a reader that addresses them in place sees them (the fused cache write): the
    tensors they lie in (whoever holds this keeps them alive: the blocks themselves, one each,
    or the buffer :func:`copy_rows` packed them into), their data pointers and token counts
    (int64 NumPy arrays, one entry per block), and the layout they all share. Every
    block is contiguous. In fp8 (``layout.fp8``) each block has its ``dequant`` too, at
    ``dequant_addresses`` (zeros otherwise), all on one device (the pinned store keeps them in
    GPU memory beside host blocks)."""

    blocks: tuple[torch.Tensor, ...]
    addresses: np.ndarray
    lengths: np.ndarray
    layout: KVLayout
    dequant: tuple[torch.Tensor, ...] = ()
    dequant_addresses: np.ndarray | None = None  # (None: zeros, one per block)

    def __post_init__(self):
        if self.dequant_addresses is None:
            object.__setattr__(self, "dequant_addresses", np.zeros(len(self.blocks), np.int64))

    @classmethod
    def of(cls, blocks: Sequence[torch.Tensor], dequant: Sequence[torch.Tensor] = (),
           layout: KVLayout | None = None) -> HeldBlocks:
        """Checked: ``[2, L, T, H, D]`` blocks, contiguous, of one layout, on one device (and
        ``layout``'s, where given: an fp8 one's blocks come with their ``dequant``)."""
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
        layout = layout or KVLayout(int(layers), int(heads), int(size), first.dtype)
        if layout.block_shape(0)[:2] + layout.block_shape(0)[3:] != first.shape[:2] + first.shape[3:] \
                or layout.stored_dtype != first.dtype:
            raise ValueError(f"blocks of {first.dtype} {tuple(first.shape)} are not {layout.describe()}")
        _check_dequant(layout, dequant, len(blocks))
        return cls(tuple(blocks), _addresses(blocks), np.fromiter((b.shape[2] for b in blocks), np.int64, len(blocks)),
                   layout, tuple(dequant), _addresses(dequant) if dequant else None)

    @classmethod
    def empty(cls, layout: KVLayout) -> HeldBlocks:
        return cls((), _NONE, _NONE, layout)

    def __add__(self, other: HeldBlocks) -> HeldBlocks:
        if other.layout != self.layout or (self.blocks and other.blocks
                                           and other.blocks[0].device != self.blocks[0].device):
            raise ValueError(f"blocks of two layouts or devices: {self.layout.describe()} and {other.layout.describe()}")
        return HeldBlocks(self.blocks + other.blocks, np.concatenate((self.addresses, other.addresses)),
                          np.concatenate((self.lengths, other.lengths)), self.layout, self.dequant + other.dequant,
                          np.concatenate((self.dequant_addresses, other.dequant_addresses)))

    @property
    def packed(self) -> bool:
        """Whether the blocks lie in one buffer (:func:`copy_rows`), not one tensor each."""
        return len(self.blocks) != len(self.addresses)

    def select(self, rows: Sequence[int]) -> HeldBlocks:
        """The blocks at ``rows``, in that order (of blocks held one tensor each)."""
        if self.packed:
            raise ValueError("blocks packed into one buffer are not selected by row")
        index = np.asarray(rows, dtype=np.int64)
        return HeldBlocks(tuple(self.blocks[i] for i in rows), self.addresses[index], self.lengths[index],
                          self.layout, tuple(self.dequant[i] for i in rows) if self.dequant else (),
                          self.dequant_addresses[index])


def copy_rows(held: HeldBlocks, rows: np.ndarray, device: torch.device) -> HeldBlocks | None:
    """The blocks at ``rows`` (in that order) copied to ``device`` into one new buffer, with one
    copy for each run of them that lies back to back in the buffer of ``held``'s first block (a
    pinned store packs a user's facts into one host buffer, in insertion order, so a request's
    facts are a few runs): a handful of host calls whatever the number of facts, where a copy of
    each fact costs an allocation and a copy call apiece (~1 ms of the engine's thread for 50).
    Host blocks bound for a GPU are copied with ``non_blocking=True`` (one DMA a run, on the
    current stream); others as ``Tensor.to`` copies them. An fp8 layout's dequant stays where it
    is held. None where the blocks do not all lie in that buffer, or the dequant does not lie on
    ``device``: copy each block instead."""
    if not held.blocks or held.packed or not len(rows):
        return None
    if held.layout.fp8 and held.dequant and held.dequant[0].device != device:
        return None
    storage = held.blocks[0].untyped_storage()
    base, size = storage.data_ptr(), storage.nbytes()
    starts = held.addresses[rows]
    nbytes = held.lengths[rows] * held.layout.token_nbytes()
    if starts.min() < base or (starts + nbytes).max() > base + size:
        return None
    order = np.unique(starts, return_index=True)[1]  # each block once, by address
    first, stop = starts[order], starts[order] + nbytes[order]
    opens = np.ones(len(first), dtype=bool)
    opens[1:] = first[1:] != stop[:-1]  # a run begins where a block does not follow the one before
    run_of = np.cumsum(opens) - 1
    run_first = first[opens]
    run_stop = np.append(stop[np.flatnonzero(opens)[1:] - 1], stop[-1])
    run_at = np.concatenate(([0], np.cumsum(run_stop - run_first)))  # each run's offset in the buffer
    held_bytes = torch.empty(0, dtype=torch.uint8, device=held.blocks[0].device).set_(storage)
    buffer = torch.empty(int(run_at[-1]), dtype=torch.uint8, device=device)
    non_blocking = device.type == "cuda" and held_bytes.device.type == "cpu"
    for run in range(len(run_first)):
        source = held_bytes[run_first[run] - base:run_stop[run] - base]
        buffer[run_at[run]:run_at[run + 1]].copy_(source, non_blocking=non_blocking)
    moved = buffer.data_ptr() + run_at[run_of] + (first - run_first[run_of])  # each block's copy, by address
    addresses = moved[np.searchsorted(first, starts)]
    return HeldBlocks((buffer,), addresses, held.lengths[rows], held.layout, held.dequant,
                      held.dequant_addresses[rows])


def _addresses(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    return np.fromiter((t.data_ptr() for t in tensors), np.int64, len(tensors))


def _check_dequant(layout: KVLayout, dequant: Sequence[torch.Tensor], count: int) -> None:
    """An fp8 layout's blocks each have a contiguous dequant of its shape, all on one device; others none."""
    if not layout.fp8:
        if dequant:
            raise ValueError(f"blocks of {layout.describe()} have no dequant")
        return
    shape = layout.dequant_shape()
    if len(dequant) != count or any(tuple(d.shape) != shape or d.dtype != DEQUANT_DTYPE or not d.is_contiguous()
                                    or d.device != dequant[0].device for d in dequant):
        raise ValueError(f"fp8 blocks need each a contiguous {DEQUANT_DTYPE} dequant {list(shape)}, on one device")


def stack_block(kv: FactKV | Fp8KV, device: torch.device) -> torch.Tensor:
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


def gather_dequantized(blocks: Sequence[torch.Tensor], dequant: Sequence[torch.Tensor], dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
    """fp8 blocks, each moved to ``device`` (a copy of half the bytes, as :func:`move_blocks`),
    dequantized there into ``dtype`` and concatenated along the token axis."""
    parts = [dequantize_block(block, scales, dtype)
             for block, scales in zip(move_blocks(blocks, device), move_blocks(dequant, device))]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


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
