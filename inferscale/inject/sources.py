"""Where a step's K/V lies and where it goes: the fused cache write's table.

For each token the fused write (:mod:`inferscale.inject.fused_write`) reads one column of an
int64 table: the addresses of the token's stored key and value rows, the stride between layers,
its cache slot, its position, its keys' scale and, for K/V kept in fp8, the address of its
fact's dequant (:mod:`inferscale.kv_fp8`). :func:`segment_sources` builds that table from the
blocks a store holds (:class:`~inferscale.storage.blocks.HeldBlocks`) for every token of a load.

It runs on the engine's critical path once per injected request, after vLLM's own work has left
the CPU's caches cold; there each NumPy call costs 10-15 µs whatever its size, and the table took a
dozen of them (~0.15-0.2 ms). The table is therefore filled by one loop compiled with Numba (a
dependency of vLLM itself): one call, ~0.03 ms cold (``benchmarks/host_path.py``). :func:`ready`
compiles it ahead of the first request.

Numba is imported on first use only, which on an engine is the worker of a build with the fused
write (CUDA): vLLM's CPU build (0.32) scans every module's globals when a worker starts and fails
on one of llvmlite's once Numba is imported in its process, and that build never takes this path.
"""

from __future__ import annotations

import functools
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inferscale.storage.blocks import HeldBlocks

logger = logging.getLogger(__name__)

#: rows of a :class:`Sources` table
K_ADDR, V_ADDR, LAYER_STRIDE, SLOT, POSITION, SCALE, DEQUANT = range(7)
ROWS = 7
#: the float32 bits of a key scale of 1.0
ONE_BITS = 0x3F800000


@dataclass(frozen=True)
class Sources:
    """Where each token's K/V lies and where it goes, packed in one int64 ``table`` so that it
    reaches the device in one copy. Per token (one column): the address of its layer-0 key row
    (row ``K_ADDR``) and value row (``V_ADDR``), the distance in elements from one layer's row to
    the next (``LAYER_STRIDE``), its cache slot (``SLOT``), its position (``POSITION``), the
    float32 bits of its keys' scale (``SCALE``) and the address of its fact's dequant (``DEQUANT``;
    0 unless ``dtype`` is fp8). ``dtype`` and ``num_heads`` are the stored K/V's. ``blocks`` are
    the tensors the addresses point into: the caller keeps them alive until the kernel has run."""

    table: torch.Tensor
    dtype: torch.dtype
    num_heads: int
    blocks: tuple[torch.Tensor, ...]

    @property
    def num_tokens(self) -> int:
        return self.table.shape[1]

    @property
    def in_host_memory(self) -> bool:
        """Whether the K/V it points at lies in (pinned) host memory."""
        return bool(self.blocks) and self.blocks[0].device.type == "cpu"

    @classmethod
    def join(cls, parts: Sequence[Sources]) -> Sources:
        """Several requests' sources as one (one table copy, one launch); they must share the
        stored dtype and head count (every fact was encoded by the served model)."""
        first = parts[0]
        for part in parts[1:]:
            if part.dtype != first.dtype or part.num_heads != first.num_heads:
                raise ValueError(f"sources of {first.dtype} × {first.num_heads} heads and "
                                 f"{part.dtype} × {part.num_heads} heads cannot be joined")
        if len(parts) == 1:
            return first
        table = torch.from_numpy(np.concatenate([part.table.numpy() for part in parts], axis=1))
        return cls(table, first.dtype, first.num_heads, tuple(b for part in parts for b in part.blocks))

    def to(self, device: torch.device, pinned: bool = False) -> Sources:
        """On ``device``: one asynchronous copy of the table. From pageable memory CUDA stages the
        few kilobytes before the call returns, so the table may be freed at once, and on the
        forward stream that costs less host time than pinning it first; but the call may hold
        the host until the work queued ahead of the copy on its stream has run. ``pinned``:
        stage the table in pinned memory first (torch's caching host allocator keeps the buffer
        until the copy has run), for a stream with work queued ahead (a background load's stream
        waits for the forward pass: there the pageable copy held the engine's thread 6 % of a
        loaded row, ~0.4 ms a request, on an H100)."""
        if device.type != "cuda":
            return self
        table = (self.table.pin_memory() if pinned else self.table).to(device, non_blocking=True)
        return Sources(table, self.dtype, self.num_heads, self.blocks)


def segment_sources(prefix: HeldBlocks, facts: HeldBlocks, start: int, end: int, cache_blocks: Sequence[int],
                    block_size: int, key_scale: float = 1.0, rows: np.ndarray | None = None
                    ) -> tuple[Sources, int]:
    """Sources of tokens ``start..end-1`` of a segment (positions 0, 1, ...): every block of
    ``prefix``, then the blocks of ``facts`` at ``rows`` (an int64 array; None: all of them, in
    order), whose keys are multiplied by ``key_scale``; to be written to the paged cache's
    ``cache_blocks`` of ``block_size`` slots each (token ``start`` in the first, at slot
    ``start % block_size``, and so on as in a block table). Returns them and the segment's
    length. The stored blocks are picked by row, not gathered: a store hands over all of a
    user's blocks and the rows of a request's facts among them."""
    cache_blocks = check_cache_blocks(cache_blocks, block_size, start, end)
    layout = prefix.layout
    if facts.layout != layout or (facts.blocks and prefix.blocks[0].device != facts.blocks[0].device):
        raise ValueError(f"blocks of two layouts or devices: {layout.describe()} and {facts.layout.describe()}")
    table = np.empty((ROWS, end - start), dtype=np.int64)
    picked = _ALL if rows is None else rows
    written, total = _compiled()(table, prefix.addresses, prefix.lengths, prefix.dequant_addresses, facts.addresses,
                                 facts.lengths, facts.dequant_addresses, picked, rows is not None, start, cache_blocks,
                                 block_size, layout.num_kv_heads * layout.head_size, layout.stored_dtype.itemsize,
                                 layout.num_layers, _float_bits(key_scale))
    if written < 0:
        raise ValueError(f"a row past the {len(facts.lengths)} blocks held")
    if written != end - start:
        raise ValueError(f"tokens {start}..{end - 1} outside a segment of {total} tokens")
    held = prefix.blocks + facts.blocks + prefix.dequant + facts.dequant
    return Sources(torch.from_numpy(table), layout.stored_dtype, layout.num_kv_heads, held), total


_ALL = np.zeros(0, dtype=np.int64)


def check_cache_blocks(cache_blocks: Sequence[int], block_size: int, start: int, end: int) -> np.ndarray:
    """``cache_blocks`` as int64, checked to be the blocks of ``block_size`` slots that tokens
    ``start..end-1`` span, laid out as in a block table (token ``start`` at slot
    ``start % block_size`` of the first); a ValueError otherwise (no slot is ever guessed)."""
    blocks = np.asarray(cache_blocks, dtype=np.int64)
    if start < 0 or not isinstance(block_size, int) or block_size < 1 or blocks.ndim != 1 \
            or len(blocks) != ((end - 1) // block_size - start // block_size + 1 if end > start else 0):
        raise ValueError(f"{len(blocks)} cache blocks of {block_size!r} slots for tokens {start}..{end - 1}")
    return blocks


def _float_bits(value: float) -> int:
    """The float32 bits of ``value`` as a (signed) int32, as the kernel reads a key scale."""
    return ONE_BITS if value == 1.0 else struct.unpack("<i", struct.pack("<f", value))[0]


@functools.cache
def _compiled():
    """:func:`_fill` compiled (Numba imported here: see the module)."""
    import numba

    return numba.njit(nogil=True, cache=False)(_fill)


def _fill(table, prefix_addresses, prefix_lengths, prefix_dequant, fact_addresses, fact_lengths, fact_dequant, rows,
          by_row, start, cache_blocks, block_size, row, size, num_layers, scale_bits):
    """Columns ``0..`` of ``table`` for segment positions ``start..start + table.shape[1] - 1``
    (:func:`_compiled`). The segment's blocks: the prefix's, then the facts' (those at ``rows`` when
    ``by_row``). A block of ``T`` tokens at address ``A`` is ``[2, L, T, H, D]``: a token's
    layer-0 key row lies ``row`` elements after the one before, a layer's rows ``T * row`` after
    the layer before's, the values ``L * T * row`` after the keys. A token's slot is read off
    ``cache_blocks`` (the first holds position ``start``); its dequant's address is its block's
    entry of ``prefix_dequant`` or ``fact_dequant``. Returns the number of columns
    written (fewer than asked when the segment is shorter) and the segment's length; -1, -1 for a
    row past the facts' blocks."""
    end = start + table.shape[1]
    first_block = start // block_size
    num_prefix = prefix_lengths.shape[0]
    num_blocks = num_prefix + (rows.shape[0] if by_row else fact_lengths.shape[0])
    column, first = 0, 0
    for block in range(num_blocks):
        if block < num_prefix:
            address, length, scale = prefix_addresses[block], prefix_lengths[block], ONE_BITS
            dequant = prefix_dequant[block]
        else:
            fact = rows[block - num_prefix] if by_row else block - num_prefix
            if fact < 0 or fact >= fact_lengths.shape[0]:  # (compiled code checks no bounds)
                return -1, -1
            address, length, scale = fact_addresses[fact], fact_lengths[fact], scale_bits
            dequant = fact_dequant[fact]
        stride = length * row
        base = address - first * row * size  # where its token 0 would lie at its segment position
        for position in range(max(start, first), min(end, first + length)):
            key = base + position * row * size
            table[K_ADDR, column] = key
            table[V_ADDR, column] = key + stride * num_layers * size
            table[LAYER_STRIDE, column] = stride
            block = cache_blocks[position // block_size - first_block]
            table[SLOT, column] = block * block_size + position % block_size
            table[POSITION, column] = position
            table[SCALE, column] = scale
            table[DEQUANT, column] = dequant
            column += 1
        first += length
    return column, first


@functools.cache
def ready() -> bool:
    """Whether the table can be built here: :func:`_fill` compiled now (a fraction of a second, once
    per process), not on the first request's path. False, with the reason logged, where Numba is
    missing or cannot compile it: the connector then writes each layer through the cache's views
    instead of the fused write."""
    one = np.ones(1, dtype=np.int64)
    try:
        _compiled()(np.empty((ROWS, 1), dtype=np.int64), one, one, one, one, one, one, _ALL, False, 0, one, 1, 1, 2, 1,
                    ONE_BITS)
    except Exception as exc:
        logger.warning("inferscale: the fused cache write is off: its sources table does not compile "
                       "(%s: %s)", type(exc).__name__, exc)
        return False
    return True
