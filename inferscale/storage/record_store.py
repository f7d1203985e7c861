"""The store of record's contract: the calls the memory side, the scheduler and the memory tier's
loader make on ``Config.store`` (:func:`~inferscale.storage.tiers.disk_tier`).

It is the one store writers write and every other tier is a cache of: the disk store (``"disk"``,
under ``<data_dir>/kv``, or any ``root``, a shared filesystem included) or a networked one
(``"redis"``: :class:`~inferscale.storage.redis_store.RedisStore`) that replicas share. Beyond
:class:`~inferscale.storage.base.KVStore` it commits a fact whole with its record and embedding
(``put(..., records, embeddings, drop)``), and serves the records, the embeddings, one version of a
whole user (``read_user``) and the user's epoch, which changes with every write and is what
per-replica caches (memory tiers, retrieval indexes, cache salts) are invalidated by.
"""

from __future__ import annotations

from inferscale.errors import ConfigError

#: every name of the contract
CONTRACT = ("name", "put", "get", "delete", "list", "users", "nbytes", "epoch", "token_ids", "epoch_token_ids",
            "facts", "embeddings", "read_user", "sweep")


def check_record_store(store: object):
    """``store``, checked to be durable and to offer every call of the contract; a
    :class:`ConfigError` names what it lacks."""
    missing = [n for n in CONTRACT if not hasattr(store, n) or (n != "name" and not callable(getattr(store, n)))]
    cls = type(store)
    where = f"store {getattr(store, 'name', '?')!r} ({cls.__module__}.{cls.__qualname__})"
    if getattr(store, "volatile", True):
        raise ConfigError(f"{where} keeps K/V in process memory: the store of record must be durable "
                          f"(disk, redis or a plugin's)")
    if missing:
        raise ConfigError(f"{where} cannot be the store of record: it lacks {', '.join(missing)} "
                          f"(the contract: inferscale.storage.record_store)")
    return store
