"""KV stores: where facts' pre-RoPE K/V live, per user.

``base.py`` is the interface every store implements (:class:`KVStore`, selected by name through
:func:`inferscale.config.build`; ``plugin.py`` registers the built-ins), ``layout.py`` the shape of
a user's K/V (:class:`~inferscale.storage.layout.KVLayout`) and the checks every store makes,
``blocks.py`` a fact's K/V as one block and the gather of blocks into a batch. One entry per
built-in store: ``hbm.py`` (``"hbm"``, on the accelerator) and ``pinned.py`` (``"pinned"``, in
pinned host memory), the memory tiers, over what they share in ``resident/`` (the byte budget,
LRU eviction); ``disk/`` (``"disk"``) and ``redis/`` (``"redis"``, shared by replicas), the stores of
record, over the format they share in ``format/`` (a user's index and K/V segments). ``tiers/`` is
how a worker uses them: the memory tier and the store of record built from the Config, the
contract each fulfils, and a user loaded from one into the other. The store classes are imported
on first access, so importing this package stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from inferscale.storage.base import KVStore

if TYPE_CHECKING:
    from inferscale.storage.disk import DiskStore
    from inferscale.storage.hbm import HBMStore
    from inferscale.storage.pinned import PinnedHostStore
    from inferscale.storage.redis.store import RedisStore

_LAZY = {
    "HBMStore": "inferscale.storage.hbm",
    "PinnedHostStore": "inferscale.storage.pinned",
    "DiskStore": "inferscale.storage.disk",
    "RedisStore": "inferscale.storage.redis.store",
}

__all__ = ["DiskStore", "HBMStore", "KVStore", "PinnedHostStore", "RedisStore"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
