"""The fused write's sources table: each token's stored rows, slot, position, key scale and dequant."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.inject.sources import (DEQUANT, K_ADDR, LAYER_STRIDE, POSITION, ROWS, SCALE, SLOT, V_ADDR, Sources,
                                       segment_sources)
from inferscale.kv_fp8 import FP8, FP8_E4M3
from inferscale.storage.blocks import HeldBlocks
from inferscale.storage.layout import KVLayout

pytestmark = pytest.mark.own_process  # Numba (conftest.py)


def test_sources_point_at_each_tokens_rows():
    blocks = [torch.zeros(2, 3, n, 2, 4) for n in (2, 5)]
    prefix, facts = HeldBlocks.of(blocks[:1]), HeldBlocks.of(blocks[1:])
    # blocks of 4 slots: positions 1-3 in block 10 (slots 41-43), 4-6 in block 2 (slots 8-10)
    sources, total = segment_sources(prefix, facts, 1, 7, [10, 2], 4, key_scale=0.5)
    assert total == 7
    row = 2 * 4 * 4  # bytes of one token's heads
    expected_k = [blocks[0].data_ptr() + row] + [blocks[1].data_ptr() + i * row for i in range(5)]
    assert sources.table[K_ADDR].tolist() == expected_k
    assert sources.table[LAYER_STRIDE].tolist() == [2 * 8] + [5 * 8] * 5
    assert (sources.table[V_ADDR] - sources.table[K_ADDR]).tolist() == [3 * 2 * 8 * 4] + [3 * 5 * 8 * 4] * 5
    assert sources.table[SLOT].tolist() == [41, 42, 43, 8, 9, 10]
    assert sources.table[POSITION].tolist() == [1, 2, 3, 4, 5, 6]
    assert sources.table[SCALE].to(torch.int32).view(torch.float32).tolist() == [1.0, 0.5, 0.5, 0.5, 0.5, 0.5]
    assert sources.table[DEQUANT].tolist() == [0] * 6  # (K/V in the model's dtype)
    joined = Sources.join([sources, segment_sources(prefix, facts, 0, 2, [3], 2)[0]])
    assert joined.table[SLOT].tolist() == [41, 42, 43, 8, 9, 10, 6, 7] and len(joined.blocks) == 4
    with pytest.raises(ValueError, match="joined"):  # stored in another dtype
        other = HeldBlocks.of([blocks[0].to(torch.bfloat16)])
        Sources.join([sources, segment_sources(other, HeldBlocks.empty(other.layout), 0, 2, [3], 2)[0]])
    for table, size in (([1], 4), ([1, 2, 3], 4), ([1, 2], 0), ([[1, 2]], 4)):  # tokens 1..6 span 2 of 4
        with pytest.raises(ValueError, match="cache blocks"):
            segment_sources(prefix, facts, 1, 7, table, size)
    with pytest.raises(ValueError):  # not contiguous
        HeldBlocks.of([blocks[0], torch.zeros(2, 3, 4, 2, 4).transpose(3, 4)])
    with pytest.raises(ValueError):  # another layout
        HeldBlocks.of([blocks[0], torch.zeros(2, 3, 4, 2, 8)])
    with pytest.raises(ValueError, match="two layouts"):  # facts of another layout than the prefix
        segment_sources(prefix, HeldBlocks.of([torch.zeros(2, 3, 4, 2, 4, dtype=torch.bfloat16)]), 0, 2, [3], 2)


def reference(blocks: list[torch.Tensor], start: int, end: int, slots: list[int], key_scale: float,
              dequant: list[torch.Tensor]) -> list[list[int]]:
    """The table's columns, token by token, from the blocks' tensors themselves (the first block
    is the prefix: its keys unscaled; ``dequant``: each block's, or none)."""
    columns, position = [], 0
    for index, block in enumerate(blocks):
        scales = dequant[index].data_ptr() if dequant else 0
        row = block.shape[3] * block.shape[4]
        for token in range(block.shape[2]):
            if start <= position < end:
                scale = key_scale if index > 0 else 1.0
                columns.append([block[0, 0, token].data_ptr(), block[1, 0, token].data_ptr(), block.shape[2] * row,
                                slots[position - start], position, struct.unpack("<i", struct.pack("<f", scale))[0],
                                scales])
            position += 1
    return columns


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.lists(st.integers(1, 9), max_size=8), st.data(),
       st.sampled_from([torch.float32, torch.bfloat16, FP8]), st.sampled_from([1.0, 0.5, 1.25, 3.0]))
def test_sources_match_each_tokens_stored_rows(prefix_len, lengths, data, dtype, key_scale):
    """Any facts, picked in any order among a user's blocks or given as they are, any range of
    the segment, any cache blocks, K/V in the model's dtype or in fp8: every column names the
    token's own key and value rows in its block, its slot, its position, its scale and its
    fact's dequant."""
    layout = KVLayout(3, 2, 4, torch.bfloat16, FP8_E4M3) if dtype == FP8 else KVLayout(3, 2, 4, dtype)
    prefix = torch.zeros(2, 3, prefix_len, 2, 4, dtype=dtype)
    held = [torch.zeros(2, 3, n, 2, 4, dtype=dtype) for n in lengths]
    dequant = [torch.zeros(layout.dequant_shape(), dtype=torch.bfloat16) for _ in range(1 + len(held))] \
        if layout.fp8 else []
    rows = data.draw(st.none() | st.permutations(range(len(held))).flatmap(
        lambda order: st.integers(0, len(order)).map(lambda n: order[:n])))
    picked = held if rows is None else [held[r] for r in rows]
    picked_dequant = dequant[:1] + (dequant[1:] if rows is None else [dequant[1 + r] for r in rows]) if dequant else []
    facts = HeldBlocks.of(held, dequant[1:], layout) if held else HeldBlocks.empty(layout)
    total = prefix_len + sum(b.shape[2] for b in picked)
    start = data.draw(st.integers(0, total))
    end = data.draw(st.integers(start, total))
    block_size = data.draw(st.sampled_from([1, 2, 3, 16]))
    spanned = (end - 1) // block_size - start // block_size + 1 if end > start else 0
    cache_blocks = data.draw(st.lists(st.integers(0, 1 << 36), min_size=spanned, max_size=spanned))
    slots = [cache_blocks[p // block_size - start // block_size] * block_size + p % block_size
             for p in range(start, end)]
    sources, length = segment_sources(HeldBlocks.of([prefix], dequant[:1], layout), facts, start, end, cache_blocks,
                                      block_size, key_scale, None if rows is None else np.asarray(rows, dtype=np.int64))
    assert length == total and sources.table.shape == (ROWS, end - start) and sources.dtype == dtype
    assert sources.table.T.tolist() == reference([prefix, *picked], start, end, slots, key_scale, picked_dequant)
    kept = {b.data_ptr() for b in sources.blocks}
    assert {b.data_ptr() for b in [prefix, *picked, *picked_dequant]} <= kept


def test_sources_refuse_tokens_past_the_segment():
    prefix = HeldBlocks.of([torch.zeros(2, 3, 4, 2, 4)])
    facts = HeldBlocks.empty(prefix.layout)
    with pytest.raises(ValueError, match="outside a segment of 4 tokens"):
        segment_sources(prefix, facts, 2, 6, [0, 1], 4)
    with pytest.raises(ValueError, match="outside"):
        segment_sources(prefix, facts, 5, 6, [0], 4)
    held = HeldBlocks.of([torch.zeros(2, 3, 2, 2, 4)])
    for row in (1, -1):  # never an address read off the end of the table
        with pytest.raises(ValueError, match="past the 1 blocks"):
            segment_sources(prefix, held, 0, 4, [0], 4, rows=np.array([0, row], dtype=np.int64))


def test_a_table_that_cannot_compile_turns_the_fused_write_off(monkeypatch, caplog):
    """Where Numba is missing or cannot compile the loop, ready() says so once, with the reason,
    and the connector writes each layer through the backend's op instead of failing to start."""
    from inferscale.inject import sources

    def missing():  # the fault: no Numba in this environment
        raise ImportError("No module named 'numba'")

    monkeypatch.setattr(sources, "_compiled", missing)
    sources.ready.cache_clear()
    with caplog.at_level("WARNING", logger="inferscale.inject.sources"):
        assert sources.ready() is False and sources.ready() is False
    assert caplog.text.count("fused cache write is off") == 1 and "No module named 'numba'" in caplog.text
    monkeypatch.undo()
    sources.ready.cache_clear()
    assert sources.ready() is True
