"""The stores' cache of parsed user indexes, bounded by the memory they take.

A parsed index is Python objects: every token id an int in a tuple. It takes about 4.4 times
its JSON file (a 20,000-fact user: a 6.4 MB file, 28 MB parsed; measured with tracemalloc), so
the cache counts :data:`PARSED_BYTES_PER_BYTE` times each index's file (or Redis value) against
``max_bytes`` and drops the least recently used past it. The disk store keys an entry by the
index file's path and checks it against the file's identity
(:func:`inferscale.files.identity`: inode, size, times), so a rewritten index is read
again and replaces the old one; the Redis store keys it by user and checks the epoch.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path

from inferscale.errors import CorruptDataError
from inferscale import files
from inferscale.storage.format.index import UserIndex

#: what a parsed index takes in memory per byte of its file, rounded up from the 4.4 measured
PARSED_BYTES_PER_BYTE = 5
#: the default bound of a store's cache (``index_cache_mib`` in the store's options)
DEFAULT_MIB = 256


class IndexCache:
    """Thread-safe; readers share it without the store's write lock."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, tuple[object, UserIndex, int]] = OrderedDict()  # key → (tag, index, cost)
        self.nbytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, tag: object) -> UserIndex | None:
        """The index cached under ``key`` if it was cached with ``tag`` (a file's identity, an epoch)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] != tag:
                return None
            self._entries.move_to_end(key)
            return entry[1]

    def put(self, key: Hashable, tag: object, index: UserIndex, stored_bytes: int) -> None:
        """Remember ``index`` (read from ``stored_bytes`` of file or value), replacing what ``key`` held."""
        cost = stored_bytes * PARSED_BYTES_PER_BYTE
        with self._lock:
            self._drop(key)
            self._entries[key] = (tag, index, cost)
            self.nbytes += cost
            while self._entries and self.nbytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def pop(self, key: Hashable) -> None:
        with self._lock:
            self._drop(key)

    def read(self, path: str, user_id: str, read: Callable[[Path, str], UserIndex]) -> UserIndex | None:
        """The index in ``path`` (None: no such file), from the cache while the file is unchanged,
        else ``read(path, user_id)``."""
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            self.pop(path)
            return None
        identity = files.identity(stat)
        if (hit := self.get(path, identity)) is not None:
            return hit
        try:
            index = read(Path(path), user_id)
        except FileNotFoundError:
            return None
        except RecursionError:
            raise CorruptDataError(f"{path}: not a readable index (nested too deeply)") from None
        self.put(path, identity, index, stat.st_size)
        return index

    def _drop(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry[2]


def cache_bytes(mib: object) -> int:
    """``index_cache_mib`` of a store's options, checked: a positive integer of MiB."""
    if isinstance(mib, bool) or not isinstance(mib, int) or mib < 1:
        raise ValueError(f"index_cache_mib must be a positive integer (MiB), got {mib!r}")
    return mib << 20
