"""One user's facts as an in-process store holds them (:mod:`inferscale.storage.resident.store`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import torch

from inferscale.storage.blocks import HeldBlocks
from inferscale.storage.layout import KVLayout


@dataclass(frozen=True)
class UserKV:
    """One user's facts: blocks ``[2, L, T, H, D]`` and token ids, in insertion order (in fp8, each
    fact's dequant too)."""

    layout: KVLayout
    blocks: Mapping[str, torch.Tensor]
    token_ids: Mapping[str, tuple[int, ...]]
    epoch: str
    dequant: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes(len(ids) for ids in self.token_ids.values())

    @cached_property
    def device(self) -> torch.device:
        """Where the user's blocks lie (all on one device)."""
        return next(iter(self.blocks.values())).device

    @cached_property
    def held(self) -> tuple[dict[str, int], HeldBlocks]:
        """Each fact's row in one :class:`HeldBlocks` of all the user's blocks (built on first
        use: a request then picks its facts' rows instead of inspecting each block)."""
        held = HeldBlocks.of(list(self.blocks.values()), [self.dequant[f] for f in self.blocks if self.dequant],
                             self.layout)
        return {fact_id: row for row, fact_id in enumerate(self.blocks)}, held
