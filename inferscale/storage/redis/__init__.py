"""The Redis store (``"redis"``, :class:`~inferscale.storage.redis.store.RedisStore`): the store of
record that replicas share (docs/cluster.md), the disk store's format 3 without the files: each
user one Redis hash of its index and K/V segments. ``store.py`` is the store and its reads,
``writes.py`` how it commits (one ``MULTI``/``EXEC`` per change, guarded by ``WATCH``). Needs the
``cluster`` extra (``redis``), imported only when a store is made."""
