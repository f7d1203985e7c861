"""Worker side, vLLM-free: turn a load request into post-RoPE K/V for this rank.

The KV store lives in the worker process. A user's facts are loaded from the
disk tier on first use and then kept by the store (pinned host or HBM).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inferscale.compose.rope import RotaryEmbedding
from inferscale.compose.segment import SYSTEM_USER, Segment, gather_segment
from inferscale.compose.request import SegmentRequest
from inferscale.errors import MissingFactError, ModelMismatchError
from inferscale.kv import KVBatch
from inferscale.storage.base import KVStore
from inferscale.storage.tiered import ensure_user


@dataclass(frozen=True)
class LoadSpec:
    """One request's load, as the scheduler sends it (picklable, no tensors).

    Tokens ``start..end-1`` of the ``segment_len``-token segment go to
    ``slots`` (one slot per token); ``salt`` is the segment's cache salt: the
    worker re-derives it from the token ids it gathered, so K/V is never
    written under other tokens. The facts' keys are multiplied by
    ``key_scale`` (:mod:`inferscale.compose.blend`).
    """

    req_id: str
    request: SegmentRequest
    start: int
    end: int
    segment_len: int
    slots: tuple[int, ...]
    salt: str
    key_scale: float = 1.0

    @property
    def user_id(self) -> str:
        return self.request.user_id


def kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> slice:
    """The KV heads one tensor-parallel rank holds (vLLM replicates heads when tp > heads)."""
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ModelMismatchError(f"{num_kv_heads} KV heads do not split over {tp_size} ranks")
        per_rank = num_kv_heads // tp_size
        return slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    head = tp_rank * num_kv_heads // tp_size
    return slice(head, head + 1)


class SegmentLoader:
    def __init__(self, store: KVStore, disk: KVStore, rope: RotaryEmbedding, heads: slice,
                 device: torch.device | str, dtype: torch.dtype):
        self.store, self.disk, self.rope = store, disk, rope
        self.heads, self.device, self.dtype = heads, torch.device(device), dtype

    def load(self, spec: LoadSpec, num_layers: int, head_size: int) -> Segment:
        """K/V for the spec's tokens, rotated to their positions, this rank's heads, cache dtype.

        Every step is a whole-tensor op over all layers (a handful of kernel
        launches, no host synchronisation): the rank's heads are sliced before
        RoPE, keys rotate in float32 from the cached cos/sin table, the facts'
        keys are scaled before the one cast to the cache dtype.
        """
        batch = self._gather(spec)
        if batch is None:  # the memory tier is stale: another process wrote to disk since
            self._refresh(spec.user_id)
            batch = self._gather(spec)
        if batch is None:
            raise ValueError("stored facts changed since the request was scheduled (token ids differ)")
        if batch.num_tokens != spec.segment_len or not 0 <= spec.start <= spec.end <= spec.segment_len \
                or len(spec.slots) != spec.end - spec.start:
            raise ValueError(f"segment has {batch.num_tokens} tokens, request expects {spec.segment_len}")
        _check_shape(batch.keys, num_layers, head_size)
        keys = self.rope.rotate_range(batch.keys[:, spec.start:spec.end, self.heads], spec.start)
        if spec.key_scale != 1.0:
            keys[:, max(0, batch.offsets[1] - spec.start):] *= spec.key_scale
        values = batch.values[:, spec.start:spec.end, self.heads].to(self.dtype)
        if not values[0].is_contiguous():
            values = values.contiguous()
        token_ids = batch.flat_token_ids()[spec.start:spec.end]
        return Segment(batch.fact_ids, spec.start, token_ids, keys.to(self.dtype), values)

    def slot_mapping(self, spec: LoadSpec) -> torch.Tensor:
        """The spec's cache slots on the loader's device, copied without a host sync."""
        slots = torch.tensor(spec.slots, dtype=torch.long)
        if self.device.type != "cuda":
            return slots.to(self.device)
        return slots.pin_memory().to(self.device, non_blocking=True)

    def _gather(self, spec: LoadSpec) -> KVBatch | None:
        """The segment's pre-RoPE K/V; None when the cached facts are not the scheduled ones."""
        for user in (SYSTEM_USER, spec.user_id):
            ensure_user(self.store, self.disk, user)
        try:
            batch = gather_segment(self.store, spec.user_id, spec.request.fact_ids, self.device)
        except MissingFactError:
            return None
        return batch if spec.request.salt(batch.flat_token_ids()) == spec.salt else None

    def _refresh(self, user_id: str) -> None:
        for user in (SYSTEM_USER, user_id):
            self.store.delete(user)
            ensure_user(self.store, self.disk, user)


def _check_shape(keys: torch.Tensor, num_layers: int, head_size: int) -> None:
    if keys.shape[0] != num_layers or keys.shape[-1] != head_size:
        raise ModelMismatchError(
            f"stored K/V has {keys.shape[0]} layers × head size {keys.shape[-1]}, "
            f"the served model {num_layers} × {head_size}: memory was encoded with another model"
        )


def slots_for(block_ids: Sequence[int], block_size: int, start: int, end: int) -> tuple[int, ...]:
    """Cache slots of token positions ``start..end-1`` given the request's block table."""
    return tuple(block_ids[p // block_size] * block_size + p % block_size for p in range(start, end))
