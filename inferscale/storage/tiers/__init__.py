"""The two tiers a worker reads facts' K/V from, and how they stay in step. The memory tier
(``Config.kv_store``: ``pinned``, ``hbm`` or a plugin's) holds whole users in the worker's process;
the store of record (``Config.store``: the disk store, Redis, or a plugin's) is the source of truth
behind it, the only one writers write. ``build.py`` builds both from the Config
(:func:`build_tiers`, :func:`store_of_record`); ``memory.py`` is the memory tier's contract
(:class:`MemoryTier`), ``record.py`` the store of record's (:class:`StoreOfRecord`), each checked
when built; ``fill.py`` loads a user from the record into the memory tier when its epoch differs
(:func:`ensure_user`)."""

from inferscale.storage.tiers.build import Tiers, build_tiers, store_of_record
from inferscale.storage.tiers.fill import ensure_user
from inferscale.storage.tiers.memory import MemoryTier, check_memory_tier
from inferscale.storage.tiers.record import StoreOfRecord, check_record_store

__all__ = ["MemoryTier", "StoreOfRecord", "Tiers", "build_tiers", "check_memory_tier", "check_record_store",
           "ensure_user", "store_of_record"]
