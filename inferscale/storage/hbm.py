"""HBMStore: facts' K/V held on the accelerator (or the CPU when there is none)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from inferscale.errors import ConfigError
from inferscale.storage.blocks import stack_block
from inferscale.storage.layout import KVLayout
from inferscale.storage.resident.store import ResidentStore, Source


class HBMStore(ResidentStore):
    """One device tensor ``[2, L, T, H, D]`` per fact; ``get`` is one ``cat`` on the device.

    The fastest tier and the smallest: everything stays in GPU memory, so a
    ``get`` onto the same device is a device-to-device gather. Volatile: fill it
    from the disk tier (:func:`inferscale.storage.tiers.fill.ensure_user`).
    """

    name: ClassVar[str] = "hbm"

    def __init__(self, options: ResidentStore.Options | None = None, **runtime: Any):
        super().__init__(options, **runtime)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"kv_store 'hbm': device {self.device} asked for but CUDA is not available")

    def _place(self, layout: KVLayout, sources: Mapping[str, Source]) -> dict[str, torch.Tensor]:
        """Keep blocks already held; stack new facts onto the device."""
        return {
            fact_id: src if isinstance(src, torch.Tensor) else stack_block(src, self.device)
            for fact_id, src in sources.items()
        }
