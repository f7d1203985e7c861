"""The memory tier's contract: every call the worker makes on ``Config.kv_store``.

:class:`~inferscale.storage.base.KVStore` is what any store offers (``put``, ``get``, ...).
The worker's memory tier offers more: it is filled from the disk tier a whole user at a time
(:func:`~inferscale.storage.tiers.fill.ensure_user`: :meth:`MemoryTier.load`) and hands its blocks to
the fused cache write where they lie (:meth:`MemoryTier.blocks`, :meth:`MemoryTier.held_rows`).
:class:`~inferscale.storage.resident.store.ResidentStore` (``"hbm"``, ``"pinned"``) is the built-in
implementation; a plugin tier may subclass it or implement the protocol itself.

:func:`check_memory_tier` runs when the tiers are built (:func:`~inferscale.storage.tiers.build_tiers`):
a tier that lacks part of the contract is refused there, with the missing names, rather than
failing on a request's path or quietly taking a slower one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from inferscale.errors import ConfigError
from inferscale.kv import FactKV, KVBatch
from inferscale.kv_fp8 import Fp8KV
from inferscale.storage.blocks import HeldBlocks


@runtime_checkable
class MemoryTier(Protocol):
    """Users' facts held in this process, filled from the disk tier and read by the worker."""

    #: the tier's name in ``Config.kv_store`` (and on ``/metrics``: ``store_hits_total{tier=...}``)
    name: str
    #: True: K/V live in process memory only; the disk tier behind fills it (:meth:`load`)
    volatile: bool
    #: True: blocks lie in page-locked host memory, which a GPU kernel may read in place
    pinned: bool
    # (optional) ``kv_dtype_at_rest``: the form it keeps facts in, ``"model"`` or ``"fp8_e4m3"``
    # (:mod:`inferscale.kv_fp8`); a tier without it is given facts in the model's dtype

    def epoch(self, user_id: str) -> str | None:
        """The version of the user's facts held (the disk's, when :meth:`load` put them there);
        None: none held."""

    def has_user(self, user_id: str) -> bool:
        """Whether any fact of the user is held."""

    def check_room(self, user_id: str, nbytes: int) -> None:
        """Raise :class:`~inferscale.errors.CapacityError` when a user of ``nbytes`` of K/V could
        never be held (checked before the disk tier reads them)."""

    def load(self, user_id: str, facts: Mapping[str, FactKV | Fp8KV], epoch: str) -> None:
        """Hold exactly ``facts`` for the user, as version ``epoch`` of the disk tier (in the tier's
        ``kv_dtype_at_rest``, :func:`~inferscale.storage.tiers.fill.ensure_user`)."""

    def delete(self, user_id: str, fact_ids: Sequence[str] | None = None) -> None:
        """Forget some facts of a user, or the whole user when ``fact_ids`` is None (idempotent)."""

    def get(self, user_id: str, fact_ids: Sequence[str], device: torch.device | str | None = None) -> KVBatch:
        """The facts' pre-RoPE K/V, concatenated in ``fact_ids`` order, on ``device`` (the
        per-layer write's source)."""

    def blocks(self, user_id: str, fact_ids: Sequence[str], device: torch.device | str | None = None
               ) -> list[torch.Tensor]:
        """Each fact's contiguous ``[2, L, T, H, D]`` block on ``device``: the held block itself
        where it lies there (the caller never writes to it), else a copy (e4m3 codes in fp8)."""

    def held_rows(self, user_id: str, fact_ids: Sequence[str], device: torch.device | str | None = None
                  ) -> tuple[HeldBlocks, np.ndarray | None]:
        """The user's blocks where they lie on ``device`` and the rows of ``fact_ids`` among them
        (int64; None: the blocks are the facts', in order): the fused write's source (in fp8 with
        each block's dequant)."""


#: every name of the contract: its attributes, then its methods
CONTRACT = ("name", "volatile", "pinned", "epoch", "has_user", "check_room", "load", "delete", "get",
            "blocks", "held_rows")
_ATTRIBUTES = CONTRACT[:3]


def missing_from_contract(tier: object) -> list[str]:
    """The names of :class:`MemoryTier` that ``tier`` lacks (methods: not callable)."""
    return [name for name in CONTRACT
            if not hasattr(tier, name) or (name not in _ATTRIBUTES and not callable(getattr(tier, name)))]


def check_memory_tier(tier: object) -> MemoryTier:
    """``tier``, checked to fulfil :class:`MemoryTier`; a :class:`ConfigError` names what it lacks."""
    missing = missing_from_contract(tier)
    if missing:
        cls = type(tier)
        raise ConfigError(f"kv_store {getattr(tier, 'name', '?')!r} ({cls.__module__}.{cls.__qualname__}) cannot "
                          f"be the worker's memory tier: it lacks {', '.join(missing)} "
                          f"(the contract: inferscale.storage.tiers.memory.MemoryTier)")
    return tier
