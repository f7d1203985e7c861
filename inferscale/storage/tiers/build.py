"""The tiers a worker reads facts' K/V from, built from the Config in one place.

The memory tier (``Config.kv_store``: ``"pinned"``, ``"hbm"`` or a plugin's) holds whole users
in this process and fulfils :class:`~inferscale.storage.tiers.memory.MemoryTier`, checked here;
the store of record (``Config.store``: the disk store under ``Config.kv_path`` by default, or a
shared one such as ``"redis"``, :mod:`inferscale.storage.tiers.record`) is the source of truth
behind it (:func:`~inferscale.storage.tiers.fill.ensure_user`), and the only one writers write.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferscale.config import Config, build
from inferscale.storage.disk import DiskStore
from inferscale.storage.tiers.memory import MemoryTier, check_memory_tier
from inferscale.storage.tiers.record import StoreOfRecord, check_record_store


@dataclass(frozen=True)
class Tiers:
    """A worker's memory tier and the store of record behind it (the disk store, Redis, or a plugin's)."""

    memory: MemoryTier
    record: StoreOfRecord


def store_of_record(config: Config) -> StoreOfRecord:
    """The store of record ``config.store`` names: the disk store under ``config.kv_path`` unless
    its options name another ``root``, or a durable plugin store (checked against its contract)."""
    if config.store.name == DiskStore.name and "root" not in config.store.options:
        return DiskStore(DiskStore.Options(root=str(config.kv_path), **config.store.options))
    return check_record_store(build("kv_store", config.store))


def build_tiers(config: Config) -> Tiers:
    """The memory tier ``config.kv_store`` names, checked against its contract (a
    :class:`~inferscale.errors.ConfigError` names what it lacks), keeping facts in
    ``config.kv_dtype_at_rest`` (a runtime key: a tier that ignores it is given the model's
    dtype, :func:`~inferscale.storage.tiers.fill.ensure_user`), and the store of record behind it."""
    memory = build("kv_store", config.kv_store, kv_dtype_at_rest=config.kv_dtype_at_rest)
    return Tiers(check_memory_tier(memory), store_of_record(config))
