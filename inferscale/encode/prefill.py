"""Forward passes over right-padded rows after cached K/V (the fact encoder's prefills).

:class:`Prefilled` holds the model's cache after some rows; :func:`forward` runs more rows
after it, each at the positions that follow its own cached tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from inferscale.devices import module_device


@dataclass(frozen=True)
class Prefilled:
    """Post-RoPE K/V of right-padded rows as the model's cache holds them: per layer
    ``(keys, values)``, each ``[batch, kv_heads, width, head_size]``; row b's own
    tokens are its first ``lengths[b]`` columns, the rest is padding."""

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    lengths: tuple[int, ...]

    @property
    def width(self) -> int:
        return self.layers[0][0].shape[2]

    def rows(self, index: Sequence[int], lengths: Sequence[int]) -> Prefilled:
        """Rows ``index`` (repeats allowed), row i read up to its first ``lengths[i]`` columns."""
        assert all(n <= self.lengths[i] for i, n in zip(index, lengths))
        idx = torch.tensor(index, device=self.layers[0][0].device)
        return Prefilled(tuple((k.index_select(0, idx), v.index_select(0, idx)) for k, v in self.layers),
                          tuple(lengths))


def pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and the mask of real tokens."""
    width = max(len(seq) for seq in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for b, seq in enumerate(seqs):
        input_ids[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    mask = torch.arange(width) < torch.tensor([len(seq) for seq in seqs])[:, None]
    return input_ids, mask


def forward(model: nn.Module, past: Prefilled | None, seqs: Sequence[Sequence[int]], pad_id: int,
            keep_cache: bool = True):
    """One forward pass over right-padded ``seqs``, row b after the first
    ``past.lengths[b]`` cached tokens, at positions from there; the cache after it
    (None when there was no past and none is kept)."""
    from transformers import DynamicCache

    device = module_device(model)
    lengths = torch.tensor(past.lengths if past else [0] * len(seqs))
    input_ids, mask = pad(seqs, pad_id)
    seen = torch.arange(past.width if past else 0) < lengths[:, None]
    positions = lengths[:, None] + torch.arange(input_ids.shape[1])
    cache = DynamicCache(past.layers) if past else DynamicCache() if keep_cache else None
    with torch.no_grad():
        model.base_model(input_ids=input_ids.to(device), attention_mask=torch.cat([seen, mask], 1).long().to(device),
                         position_ids=positions.to(device), past_key_values=cache, use_cache=cache is not None)
    return cache
