"""KV stores: where facts' pre-RoPE K/V live, per user.

``KVStore`` is the interface; ``HBMStore`` (``"hbm"``), ``PinnedHostStore``
(``"pinned"``) and ``DiskStore`` (``"disk"``) are the built-ins, selected by
name through :func:`inferscale.config.build`. The worker's memory tier
(``Config.kv_store``) fulfils more: :class:`~inferscale.storage.memory_tier.MemoryTier`,
checked when :func:`~inferscale.storage.tiers.build_tiers` builds it. The store classes
are imported on first access, so importing this package stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from inferscale.storage.base import KVStore

if TYPE_CHECKING:
    from inferscale.storage.disk import DiskStore
    from inferscale.storage.hbm import HBMStore
    from inferscale.storage.pinned import PinnedHostStore

_LAZY = {
    "HBMStore": "inferscale.storage.hbm",
    "PinnedHostStore": "inferscale.storage.pinned",
    "DiskStore": "inferscale.storage.disk",
}

__all__ = ["DiskStore", "HBMStore", "KVStore", "PinnedHostStore"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
