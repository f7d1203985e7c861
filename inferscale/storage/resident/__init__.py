"""What the in-process stores (``hbm``, ``pinned``: :mod:`inferscale.storage.hbm`,
:mod:`inferscale.storage.pinned`) share: ``store.py`` (:class:`ResidentStore`: users' facts held
as blocks within a byte budget; a subclass decides only where blocks live), ``user_kv.py`` (one
user as it is held), ``lru.py`` (the order of last use, for eviction)."""

from inferscale.storage.resident.store import ResidentStore

__all__ = ["ResidentStore"]
