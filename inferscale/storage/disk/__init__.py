"""The disk store (``"disk"``, :class:`DiskStore`): each user's facts as a directory of one index and
append-only K/V segment files (format 3, docs/storage-format.md), under ``<data_dir>/kv`` or any
``root`` (a shared filesystem included). ``store.py`` is the store and its reads, ``writes.py`` how
it commits (an exclusive lock, one new segment then the index's rename), ``legacy.py`` the files of
formats 1 and 2, read as an index and converted by their first write. The format itself, shared
with the Redis store, is :mod:`inferscale.storage.format`."""

from inferscale.storage.disk.store import DiskStore

__all__ = ["DiskStore"]
