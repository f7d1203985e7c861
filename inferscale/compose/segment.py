"""The memory segment: ``[instruction prefix | facts]`` at positions 0..m-1.

The instruction prefix is encoded once (at position 0) and stored like a fact,
under the reserved user :data:`SYSTEM_USER`. Facts' keys are stored before
RoPE; composing rotates them to their positions in the segment. The K/V are read from any
:class:`SegmentSource` (every :class:`~inferscale.storage.base.KVStore` is one): composing sits
below the stores and never imports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from inferscale.compose.rope import RotaryEmbedding
from inferscale.kv import KVBatch

SYSTEM_USER = "_system"
PREFIX_FACT = "prefix"


class SegmentSource(Protocol):
    """What a segment is read from: the two reads of a K/V store it needs."""

    def get(self, user_id: str, fact_ids: Sequence[str], device=None) -> KVBatch: ...

    def epoch_token_ids(self, user_id: str, fact_ids: Sequence[str]) -> tuple[str, list[tuple[int, ...]]]: ...


@dataclass
class Segment:
    """Token ids and post-RoPE K/V (``[layers, tokens, kv_heads, head_size]``) of
    the segment's tokens ``start..start + len(token_ids) - 1``."""

    fact_ids: list[str]
    start: int
    token_ids: list[int]
    keys: torch.Tensor
    values: torch.Tensor


def segment_parts(store: SegmentSource, user_id: str, fact_ids: Sequence[str]
                  ) -> tuple[tuple[str, str], list[tuple[int, ...]]]:
    """The epochs of the instruction prefix and of the user's memory, and the token
    ids of the segment's parts (the prefix, then each fact) in those epochs; read without
    moving any K/V."""
    prefix_epoch, (prefix,) = store.epoch_token_ids(SYSTEM_USER, [PREFIX_FACT])
    epoch, facts = store.epoch_token_ids(user_id, list(fact_ids))
    return (prefix_epoch, epoch), [tuple(prefix), *facts]


def gather_segment(store: SegmentSource, user_id: str, fact_ids: Sequence[str], device=None) -> KVBatch:
    """Prefix and facts' pre-RoPE K/V, concatenated in segment order on ``device``."""
    prefix = store.get(SYSTEM_USER, [PREFIX_FACT], device)
    facts = store.get(user_id, list(fact_ids), device)
    if facts.num_tokens == 0:
        return prefix
    return KVBatch(
        [PREFIX_FACT, *facts.fact_ids],
        [*prefix.token_ids, *facts.token_ids],
        torch.cat([prefix.keys, facts.keys], dim=1),
        torch.cat([prefix.values, facts.values], dim=1),
    )


def rotate_segment(batch: KVBatch, rope: RotaryEmbedding, start: int = 0, end: int | None = None) -> Segment:
    """Apply RoPE to the batch's keys at positions ``start..end-1`` (its place in the prompt)."""
    end = batch.num_tokens if end is None else end
    if not 0 <= start <= end <= batch.num_tokens:
        raise ValueError(f"token range {start}..{end} outside a segment of {batch.num_tokens} tokens")
    positions = torch.arange(start, end, device=batch.keys.device)
    keys = rope.rotate(batch.keys[:, start:end], positions)
    return Segment(batch.fact_ids, start, batch.flat_token_ids()[start:end], keys, batch.values[:, start:end])


def compose_segment(store: SegmentSource, rope: RotaryEmbedding, user_id: str, fact_ids: Sequence[str], device=None) -> Segment:
    """The whole segment with RoPE applied at positions 0..m-1."""
    return rotate_segment(gather_segment(store, user_id, fact_ids, device), rope)
