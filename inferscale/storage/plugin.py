"""Registers the built-in KV stores: ``hbm``, ``pinned``, ``disk`` and ``redis`` (a shared store of record)."""

from __future__ import annotations

from inferscale.hookspecs import hookimpl


@hookimpl
def register_kv_stores(register):
    from inferscale.storage.disk import DiskStore
    from inferscale.storage.hbm import HBMStore
    from inferscale.storage.pinned import PinnedHostStore
    from inferscale.storage.redis.store import RedisStore

    register(HBMStore)
    register(PinnedHostStore)
    register(DiskStore)
    register(RedisStore)
