"""One kernel launch writes a step's memory into vLLM's paged cache.

For every layer, token and KV head of this rank, the kernel reads the fact's
stored pre-RoPE key and its value straight from where the store holds them
(the facts' own blocks: no gather, no temporary copies), rotates the key to
its position with the model's cos/sin table, scales the facts' keys, casts to
the cache dtype and stores both at the token's cache slot. What the loop of
whole-tensor ops (:meth:`SegmentLoader.load` + one backend write per layer)
does in ~10 launches per layer and several full passes over the K/V, this
does in one launch and one pass, for every request of the step at once.

Sources are given per token (:mod:`inferscale.inject.sources`, joined over
requests with :meth:`Sources.join`): raw addresses, the token's position and key scale. A
block may lie in GPU memory or, under unified addressing, in pinned host memory
(each element is read once, a rotary pair by the same program). By default
(``Config.tuning.pinned_reads = "overlap"``) the connector reads pinned blocks in place,
a range of layers per launch, while the forward runs; ``"copy"`` copies them
first, which is faster when the whole read must come before the forward
(``benchmarks/fused_write_speed.py``). The destination is described by
:class:`CacheViews`: each layer's K and V views of its cache
(``[num_blocks, block_size, heads, head_size]`` with any strides, as the layout
read from the registered caches and confirmed at engine start gives them:
:mod:`inferscale.inject.cache_layout`).

The arithmetic matches :meth:`RotaryEmbedding.rotate_range`: float32
``x * cos + partner(x) * sin`` from the same table (whose rows hold a pair's
cos at both of its dims and its sin negated at the first, so the kernel reads
one cos and one sin per pair), then one cast (the compiler may fuse the
multiply-add, a difference of at most one float32 rounding before the cast to
the cache dtype).

K/V kept in fp8 (``Config.kv_dtype_at_rest``, :mod:`inferscale.kv_fp8`) are read as bytes, half
the bytes of bf16 over the bus, and dequantized as they are read: each code decoded to float32
by its bits (exact; no fp8 instruction, so any GPU Triton runs on does it), times its head's
scale plus its channel's offset (the fact's dequant, whose address the table carries) — the
same float32 ``o + s · q`` as :func:`~inferscale.kv_fp8.dequantize_block`, bit for bit, since
``s · q`` is exact — before the keys are rotated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inferscale.inject.sources import DEQUANT, ROWS, Sources
from inferscale.kv_fp8 import FP8

assert (DEQUANT, ROWS) == (6, 7), "the kernel reads the dequant row and the count at these"

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU builds): the per-layer path is used
    triton = None

_TL_DTYPES, _SRC_DTYPES = {}, {}
if triton is not None:
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
    _SRC_DTYPES = {**_TL_DTYPES, FP8: tl.uint8}  # fp8 codes read as bytes (:func:`_e4m3`)


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
                raise ValueError("the layers' cache views differ in shape, strides or dtype (K and V included)")
        if key.dtype not in _TL_DTYPES:
            raise ValueError(f"a {key.dtype} cache (known: {', '.join(map(str, _TL_DTYPES))})")
        bases = torch.tensor([[k.data_ptr() for k, _ in views], [v.data_ptr() for _, v in views]],
                             dtype=torch.int64, device=key.device)
        _, block_size, num_heads, head_size = key.shape
        return cls(bases, strides, block_size, num_heads, head_size, key.dtype)

    @property
    def num_layers(self) -> int:
        return self.bases.shape[1]


#: runtime arguments are never specialized on their values or alignment: one compiled kernel per
#: cache layout serves every step (no compilation, a latency spike, when a token count happens
#: to be 1 or a multiple of 16)
_RUNTIME_ARGS = ["table", "stride", "bases", "num_layers", "layer0", "cos", "sin", "head0", "programs"]

if triton is not None:

    @triton.jit
    def _e4m3(byte):
        """e4m3 codes (read as bytes) in float32, exactly: a normal code's exponent and mantissa bits
        moved into float32's (rebiased by 127 - 7), a subnormal one's mantissa times 2^-9. (Codes
        0x7F and 0xFF, NaN, are never stored: readers refuse them.)"""
        bits = byte.to(tl.int32)
        magnitude = bits & 0x7F
        normal = ((magnitude << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        x = tl.where(magnitude >= 8, normal, magnitude.to(tl.float32) * 0.001953125)
        return tl.where(bits >= 128, -x, x)

    @triton.jit
    def _read(row, index, mask, dequant, head, dim, FP8: tl.constexpr, HEAD_SIZE: tl.constexpr):
        """Stored elements ``row[index]``; in fp8 dequantized (float32 ``o + s · q``) with the
        ``[heads, HEAD_SIZE + 1]`` dequant rows at ``dequant`` (offsets, then the scale)."""
        if FP8:
            codes = tl.load(row + index, mask=mask, other=0)
            at = dequant + head * (HEAD_SIZE + 1)
            scale = tl.load(at + HEAD_SIZE, mask=mask, other=0.0).to(tl.float32)
            return _e4m3(codes) * scale + tl.load(at + dim, mask=mask, other=0.0).to(tl.float32)
        else:
            return tl.load(row + index, mask=mask, other=0.0)

    @triton.jit(do_not_specialize=_RUNTIME_ARGS, do_not_specialize_on_alignment=_RUNTIME_ARGS)
    def _write_kernel(table, stride, bases, num_layers, layer0, cos, sin, head0, programs,
                      S_BLOCK: tl.constexpr, S_SLOT: tl.constexpr, S_HEAD: tl.constexpr, S_DIM: tl.constexpr,
                      SRC: tl.constexpr, DST: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, ROTARY: tl.constexpr,
                      NEOX: tl.constexpr, ROW: tl.constexpr, PAIRS: tl.constexpr, REST: tl.constexpr,
                      COUNTED: tl.constexpr, FP8: tl.constexpr, STORED_HEADS: tl.constexpr):
        # one program: tokens pid, pid + programs, ... (columns of the Sources table, whose rows lie
        # `stride` apart) of one layer, every head of this rank; with one program per token, one
        # token each. COUNTED: the grid covers the table's capacity and the number of tokens in
        # use follows its seven rows; programs past it do nothing. FP8: the K/V are e4m3 codes
        # with a dequant ([2, layers, STORED_HEADS, HEAD_SIZE + 1] bfloat16) per fact.
        layer = layer0 + tl.program_id(1)
        if COUNTED:
            count = tl.load(table + 7 * stride)
        else:
            count = stride
        k_out = tl.load(bases + layer).to(tl.pointer_type(DST))
        v_out = tl.load(bases + num_layers + layer).to(tl.pointer_type(DST))
        for token in range(tl.program_id(0), count, programs):
            k_row = tl.load(table + token).to(tl.pointer_type(SRC))
            v_row = tl.load(table + stride + token).to(tl.pointer_type(SRC))
            first = tl.load(table + 2 * stride + token) * layer + head0 * HEAD_SIZE  # this layer, first head
            slot = tl.load(table + 3 * stride + token)
            position = tl.load(table + 4 * stride + token)
            scale = tl.load(table + 5 * stride + token).to(tl.int32).to(tl.float32, bitcast=True)
            dst = (slot // BLOCK_SIZE) * S_BLOCK + (slot % BLOCK_SIZE) * S_SLOT
            if FP8:  # this layer's dequant rows of the token's fact, keys' and values', from this rank's first head
                dequant = tl.load(table + 6 * stride + token).to(tl.pointer_type(tl.bfloat16))
                k_dequant = dequant + (layer * STORED_HEADS + head0) * (HEAD_SIZE + 1)
                v_dequant = dequant + ((num_layers + layer) * STORED_HEADS + head0) * (HEAD_SIZE + 1)
            else:
                k_dequant = table
                v_dequant = table

            # values: the row as it is (dequantized in fp8)
            i = tl.arange(0, ROW)
            mask = i < HEADS * HEAD_SIZE
            value = _read(v_row + first, i, mask, v_dequant, i // HEAD_SIZE, i % HEAD_SIZE, FP8, HEAD_SIZE)
            tl.store(v_out + dst + (i // HEAD_SIZE) * S_HEAD + (i % HEAD_SIZE) * S_DIM, value.to(DST), mask=mask)

            # keys: each rotary pair (a, b) read once, by this program
            j = tl.arange(0, PAIRS)
            pairs = j < HEADS * (ROTARY // 2)
            head = j // (ROTARY // 2)
            if NEOX:
                a = j % (ROTARY // 2)
                b = a + ROTARY // 2
            else:
                a = 2 * (j % (ROTARY // 2))
                b = a + 1
            src = k_row + first + head * HEAD_SIZE
            xa = _read(src, a, pairs, k_dequant, head, a, FP8, HEAD_SIZE).to(tl.float32)
            xb = _read(src, b, pairs, k_dequant, head, b, FP8, HEAD_SIZE).to(tl.float32)
            # a pair's rows hold cos at both dims and -sin / +sin (RotaryEmbedding.table): two loads
            c = tl.load(cos + position * ROTARY + a, mask=pairs, other=0.0)
            s = tl.load(sin + position * ROTARY + b, mask=pairs, other=0.0)
            out = k_out + dst + head * S_HEAD
            tl.store(out + a * S_DIM, ((xa * c - xb * s) * scale).to(DST), mask=pairs)
            tl.store(out + b * S_DIM, ((xb * c + xa * s) * scale).to(DST), mask=pairs)

            if ROTARY < HEAD_SIZE:  # the dims past the rotary ones: scaled only
                r = tl.arange(0, REST)
                rest = r < HEADS * (HEAD_SIZE - ROTARY)
                head = r // (HEAD_SIZE - ROTARY)
                dim = ROTARY + r % (HEAD_SIZE - ROTARY)
                x = _read(k_row + first, head * HEAD_SIZE + dim, rest, k_dequant, head, dim, FP8, HEAD_SIZE)
                x = x.to(tl.float32)
                tl.store(k_out + dst + head * S_HEAD + dim * S_DIM, (x * scale).to(DST), mask=rest)


def write_tokens(cache: CacheViews, sources: Sources, cos: torch.Tensor, sin: torch.Tensor, head0: int,
                 rotary_dim: int, neox: bool, layers: range | None = None, programs: int | None = None) -> None:
    """Write every token of ``sources`` (its table on the cache's device) into every layer of
    the cache, or those of ``layers`` (a contiguous range), at its slot; its key rotated to its
    position and scaled. ``cos``/``sin`` are the ``[positions, rotary_dim]`` float32 table of
    :meth:`RotaryEmbedding.table` (covering every position); ``head0`` is this rank's first KV
    head among the stored ones. ``programs``: at most this many programs per layer, each
    writing every ``programs``-th token (None: one per token). Fewer programs hold fewer of the
    GPU's SMs while they wait on slow reads, such as host memory over the bus."""
    _launch(cache, sources.table, sources.num_tokens, False, sources.dtype, cos, sin, head0, rotary_dim, neox,
            layers, programs, sources.num_heads)


def write_counted(cache: CacheViews, table: torch.Tensor, capacity: int, dtype: torch.dtype, cos: torch.Tensor,
                  sin: torch.Tensor, head0: int, rotary_dim: int, neox: bool, layers: range | None = None,
                  programs: int | None = None, stored_heads: int | None = None) -> None:
    """:func:`write_tokens` from a table of fixed ``capacity`` on the device: a flat int64 tensor
    of ``ROWS * capacity + 1`` elements, the rows of a :class:`Sources` table ``capacity`` apart
    and then the number of tokens in use (which may be anything up to the capacity when the
    kernel runs). The launch itself does not depend on that number: it can be captured in a
    CUDA graph once and replayed for any step (:mod:`write_graphs`). ``dtype`` and ``stored_heads``:
    the stored K/V's (the heads needed in fp8 only); ``layers`` and ``programs`` as for
    :func:`write_tokens`."""
    if table.numel() != ROWS * capacity + 1:
        raise ValueError(f"a table of capacity {capacity} has {ROWS * capacity + 1} elements, not {table.numel()}")
    _launch(cache, table, capacity, True, dtype, cos, sin, head0, rotary_dim, neox, layers, programs, stored_heads)


def _launch(cache: CacheViews, table: torch.Tensor, stride: int, counted: bool, dtype: torch.dtype,
            cos: torch.Tensor, sin: torch.Tensor, head0: int, rotary_dim: int, neox: bool,
            layers: range | None = None, programs: int | None = None, stored_heads: int | None = None) -> None:
    """The kernel over ``stride`` tokens (the table's row stride) of ``layers``, with at most
    ``programs`` programs per layer."""
    if triton is None:
        raise RuntimeError("the fused cache write needs Triton")
    if dtype == FP8 and not (stored_heads and head0 + cache.num_heads <= stored_heads):
        raise ValueError(f"fp8 K/V of {stored_heads} stored heads for this rank's heads {head0}..")
    layers = range(cache.num_layers) if layers is None else layers
    if layers.step != 1 or not 0 <= layers.start <= layers.stop <= cache.num_layers:
        raise ValueError(f"layers {layers} of a {cache.num_layers}-layer cache")
    if programs is not None and programs < 1:
        raise ValueError(f"programs must be at least 1, got {programs}")
    if stride == 0 or not layers:
        return
    heads, size = cache.num_heads, cache.head_size
    s_block, s_slot, s_head, s_dim = cache.strides
    programs = stride if programs is None else min(programs, stride)
    _write_kernel[(programs, len(layers))](
        table, stride, cache.bases, cache.num_layers, layers.start, cos, sin, head0, programs,
        S_BLOCK=s_block, S_SLOT=s_slot, S_HEAD=s_head, S_DIM=s_dim, SRC=_SRC_DTYPES[dtype],
        DST=_TL_DTYPES[cache.dtype], BLOCK_SIZE=cache.block_size, HEADS=heads, HEAD_SIZE=size, ROTARY=rotary_dim,
        NEOX=neox, ROW=triton.next_power_of_2(heads * size),
        PAIRS=triton.next_power_of_2(max(1, heads * rotary_dim // 2)),
        REST=triton.next_power_of_2(max(1, heads * (size - rotary_dim))), COUNTED=counted,
        FP8=dtype == FP8, STORED_HEADS=stored_heads if dtype == FP8 else 0,
    )
