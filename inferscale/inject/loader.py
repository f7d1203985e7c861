"""Worker side, vLLM-free: turn a load request into post-RoPE K/V for this rank.

The KV store lives in the worker process. A user's facts are loaded from the
store of record on first use and then kept by the store (pinned host or HBM).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inferscale.compose.rope import RotaryEmbedding
from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER, Segment, gather_segment
from inferscale.inject.sources import Sources, check_cache_blocks, segment_sources
from inferscale.compose.request import SegmentRequest
from inferscale.errors import MissingFactError, ModelMismatchError
from inferscale.kv import KVBatch
from inferscale.kv_fp8 import FP8_E4M3, MODEL
from inferscale.storage.blocks import HeldBlocks
from inferscale.storage.tiers.fill import ensure_user
from inferscale.storage.tiers.memory import MemoryTier
from inferscale.storage.tiers.record import StoreOfRecord


@dataclass(frozen=True)
class LoadSpec:
    """One request's load, as the scheduler sends it (picklable, no tensors).

    Tokens ``start..end-1`` of the ``segment_len``-token segment go to the
    cache ``blocks`` of ``block_size`` slots each, as the request's block table
    lays them out: token ``start`` in ``blocks[0]`` at slot ``start % block_size``
    (:func:`load_blocks`; the worker derives each token's slot, :attr:`slots`,
    so that a block id and not a slot per token crosses to it). ``epochs`` are
    the epochs of the instruction prefix and of the user's memory whose token ids
    the scheduler matched the prompt (and the request's cache salt) against: the
    worker loads K/V only from those epochs, so K/V is never written under other
    tokens or from another version of the user's memory (an epoch is never reused,
    so one version's token ids never change). The facts' keys are multiplied by ``key_scale``
    (:mod:`inferscale.compose.blend`).
    """

    req_id: str
    request: SegmentRequest
    start: int
    end: int
    segment_len: int
    blocks: Sequence[int]  # the cache blocks of tokens start..end-1 (:func:`load_blocks`)
    block_size: int
    epochs: tuple[str, str]
    key_scale: float = 1.0

    @property
    def user_id(self) -> str:
        return self.request.user_id

    @property
    def slots(self) -> np.ndarray:
        """Each token's cache slot (int64)."""
        return slots_in(self.blocks, self.block_size, self.start, self.end)


def kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> slice:
    """The KV heads one tensor-parallel rank holds (vLLM replicates heads when tp > heads)."""
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ModelMismatchError(f"{num_kv_heads} KV heads do not split over {tp_size} ranks")
        per_rank = num_kv_heads // tp_size
        return slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    head = tp_rank * num_kv_heads // tp_size
    return slice(head, head + 1)


_HOST = torch.device("cpu")


class SegmentLoader:
    def __init__(self, store: MemoryTier, record: StoreOfRecord, rope: RotaryEmbedding, heads: slice,
                 device: torch.device | str, dtype: torch.dtype, host_in_place: bool = False, in_place_from: int = 0,
                 copy_at_most: int | None = None):
        self.store, self.record, self.rope = store, record, rope
        self.heads, self.device, self.dtype = heads, torch.device(device), dtype
        #: the fused write's sources may point into pinned host blocks where they lie (no copy), for a
        #: step that loads at least ``in_place_from`` bytes (Config.tuning.pinned_copy_below_mib) and
        #: either finds the GPU idle or loads more than ``copy_at_most`` (pinned_copy_above_mib; None:
        #: no bound): :func:`reads_in_place`
        self.host_in_place = host_in_place and self.device.type == "cuda" and store.pinned
        self.in_place_from, self.copy_at_most = in_place_from, copy_at_most
        #: the instruction prefix's blocks where a step reads them (host or device): (its version, its blocks)
        self._prefix_held: dict[bool, tuple[str | None, HeldBlocks]] = {}

    def load(self, spec: LoadSpec, num_layers: int, head_size: int) -> Segment:
        """K/V for the spec's tokens, rotated to their positions, this rank's heads, cache dtype.

        Every step is a whole-tensor op over all layers (a handful of kernel
        launches, no host synchronisation): the rank's heads are sliced before
        RoPE, keys rotate in float32 from the cached cos/sin table, the facts'
        keys are scaled before the one cast to the cache dtype.
        """
        batch = self._read(self._gather, spec)
        _check_range(spec, batch.num_tokens)
        check_cache_blocks(spec.blocks, spec.block_size, spec.start, spec.end)  # (the sources' table checks its own)
        _check_model(batch.keys.shape[0], batch.keys.shape[-1], num_layers, head_size)
        keys = self.rope.rotate_range(batch.keys[:, spec.start:spec.end, self.heads], spec.start)
        if spec.key_scale != 1.0:
            keys[:, max(0, batch.offsets[1] - spec.start):] *= spec.key_scale
        values = batch.values[:, spec.start:spec.end, self.heads].to(self.dtype)
        if not values[0].is_contiguous():
            values = values.contiguous()
        token_ids = batch.flat_token_ids()[spec.start:spec.end]
        return Segment(batch.fact_ids, spec.start, token_ids, keys.to(self.dtype), values)

    def step_in_place(self, specs: Sequence[LoadSpec], num_layers: int, head_size: int) -> bool:
        """Whether a step loading ``specs`` reads pinned host memory in place (:attr:`host_in_place`,
        then :func:`reads_in_place`), else copies them to the device first."""
        if not self.host_in_place:
            return False
        nbytes = sum(spec.end - spec.start for spec in specs) * self.token_bytes(num_layers, head_size)
        return reads_in_place(nbytes, self.in_place_from, self.copy_at_most,
                              lambda: torch.cuda.current_stream(self.device).query())

    def copies_from_host(self, in_place: bool) -> bool:
        """Whether :meth:`sources` copies the facts from pinned host memory to a GPU (the store holds
        them there, and they are not read in place)."""
        return self.device.type == "cuda" and self.store.pinned and not (in_place and self.host_in_place)

    def token_bytes(self, num_layers: int, head_size: int) -> int:
        """The bytes of one token's K/V that a load reads from the memory tier for this rank's heads:
        one per element kept in fp8, the cache dtype's size otherwise."""
        itemsize = 1 if getattr(self.store, "kv_dtype_at_rest", MODEL) == FP8_E4M3 else self.dtype.itemsize
        return num_layers * 2 * (self.heads.stop - self.heads.start) * head_size * itemsize

    def sources(self, spec: LoadSpec, num_layers: int, head_size: int, in_place: bool | None = None) -> Sources:
        """Where the spec's tokens lie in the store, their positions and key scales (for the
        fused write, :mod:`fused_write`); checked as :meth:`load` checks. ``in_place``: point into
        pinned host blocks where they lie (default :attr:`host_in_place`; never where that is
        false), else copy them to the device."""
        in_place = self.host_in_place if in_place is None else in_place and self.host_in_place
        prefix, facts, rows = self._read(functools.partial(self._held, in_place=in_place), spec)
        _check_model(prefix.layout.num_layers, prefix.layout.head_size, num_layers, head_size)
        sources, total = segment_sources(prefix, facts, spec.start, spec.end, spec.blocks, spec.block_size,
                                        spec.key_scale, rows)
        _check_range(spec, total)
        return sources

    def _read(self, read, spec: LoadSpec):
        """``read(spec)``, once more after reloading the user when the memory tier turns out
        stale (another process wrote to the store of record since); an error when it is still not the memory
        the request was scheduled with."""
        found = read(spec)
        if found is None:
            self._refresh(spec.user_id)
            found = read(spec)
        if found is None:
            raise ValueError("stored facts changed since the request was scheduled (another version)")
        return found

    def _held(self, spec: LoadSpec, in_place: bool) -> tuple[HeldBlocks, HeldBlocks, np.ndarray | None] | None:
        """The segment's blocks: the prefix's, the user's and the rows of the request's facts among
        them (None: all, in order; :meth:`_fact_blocks`); None when the memory tier does not hold
        the scheduled epochs."""
        self._hold(spec.user_id)
        if not self._holds_epochs(spec):
            return None
        try:
            prefix = self._prefix(in_place)
            if not spec.request.fact_ids:
                return prefix, HeldBlocks.empty(prefix.layout), None
            return prefix, *self._fact_blocks(spec.user_id, spec.request.fact_ids, in_place)
        except MissingFactError:
            return None

    def _prefix(self, in_place: bool) -> HeldBlocks:
        """The instruction prefix's blocks, looked up once per version of it and place (every
        request starts with it; a pinned store's prefix is then copied once)."""
        epoch = self.store.epoch(SYSTEM_USER)
        held = self._prefix_held.get(in_place)
        if held is None or held[0] != epoch:
            blocks, rows = self._fact_blocks(SYSTEM_USER, [PREFIX_FACT], in_place)
            held = self._prefix_held[in_place] = (epoch, blocks if rows is None else blocks.select(rows))
        return held[1]

    def _fact_blocks(self, user_id: str, fact_ids: Sequence[str], in_place: bool
                     ) -> tuple[HeldBlocks, np.ndarray | None]:
        """Blocks that hold the facts on the loader's device (pinned host blocks copied into one
        buffer, one DMA per run of them back to back), or where they lie when ``in_place``, and
        the facts' rows among them (None: all, in order; :meth:`MemoryTier.held_rows`)."""
        return self.store.held_rows(user_id, fact_ids, _HOST if in_place else self.device)

    def _holds_epochs(self, spec: LoadSpec) -> bool:
        """Whether the memory tier holds the prefix and the user's memory in the epochs the
        request was scheduled with."""
        return (self.store.epoch(SYSTEM_USER), self.store.epoch(spec.user_id)) == tuple(spec.epochs)

    def slot_mapping(self, spec: LoadSpec) -> torch.Tensor:
        """The spec's cache slots on the loader's device, copied without a host sync."""
        slots = torch.from_numpy(spec.slots)
        if self.device.type != "cuda":
            return slots.to(self.device)
        return slots.pin_memory().to(self.device, non_blocking=True)

    def _gather(self, spec: LoadSpec) -> KVBatch | None:
        """The segment's pre-RoPE K/V; None when the memory tier does not hold the scheduled epochs."""
        self._hold(spec.user_id)
        if not self._holds_epochs(spec):
            return None
        try:
            return gather_segment(self.store, spec.user_id, spec.request.fact_ids, self.device)
        except MissingFactError:
            return None

    def _hold(self, user_id: str) -> None:
        """Load the user and the instruction prefix into the memory tier where it holds no copy.
        A copy it holds is not compared with the store of record on every request (a stat per user): the
        version check does that, and a stale copy fails it and is reloaded (:meth:`_read`)."""
        for user in (SYSTEM_USER, user_id):
            if self.store.epoch(user) is None:
                ensure_user(self.store, self.record, user)

    def _refresh(self, user_id: str) -> None:
        self._prefix_held.clear()
        for user in (SYSTEM_USER, user_id):
            self.store.delete(user)
            ensure_user(self.store, self.record, user)


def reads_in_place(nbytes: int, in_place_from: int, copy_at_most: int | None, gpu_idle: Callable[[], bool]) -> bool:
    """Whether a step loading ``nbytes`` of pinned host memory reads them in place rather than
    copying them to the GPU first. Fewer than ``in_place_from`` bytes (``Config.tuning.pinned_copy_below_mib``)
    are copied: an in-place read's fixed cost outweighs the bus time it hides. More than
    ``copy_at_most`` (``pinned_copy_above_mib``) are read in place: a copy would need a GPU buffer that
    large beside vLLM's own memory. In between, in place only where the GPU has nothing queued
    (``gpu_idle()``, asked last: a lone request, whose reads then overlap its own forward pass); a
    step issued while the GPU still runs the ones before is copied, on the copy engines, beside them."""
    if nbytes < in_place_from:
        return False
    if copy_at_most is not None and nbytes > copy_at_most:
        return True
    return gpu_idle()


def _check_range(spec: LoadSpec, segment_len: int) -> None:
    if segment_len != spec.segment_len or not 0 <= spec.start <= spec.end <= spec.segment_len:
        raise ValueError(f"segment has {segment_len} tokens, request expects {spec.segment_len}")


def _check_model(stored_layers: int, stored_head_size: int, num_layers: int, head_size: int) -> None:
    if stored_layers != num_layers or stored_head_size != head_size:
        raise ModelMismatchError(
            f"stored K/V has {stored_layers} layers × head size {stored_head_size}, "
            f"the served model {num_layers} × {head_size}: memory was encoded with another model"
        )


def load_blocks(block_ids: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """The cache blocks of token positions ``start..end-1``, read off the request's block table
    (the first holds position ``start``)."""
    return list(block_ids[start // block_size:(end - 1) // block_size + 1]) if end > start else []


def slots_in(blocks: Sequence[int], block_size: int, start: int, end: int) -> np.ndarray:
    """Cache slots (int64) of token positions ``start..end-1`` in ``blocks`` (:func:`load_blocks`)."""
    positions = np.arange(start, end, dtype=np.int64)
    return (np.asarray(blocks, dtype=np.int64)[positions // block_size - start // block_size] * block_size
            + positions % block_size)
