"""The disk store's cache of parsed index files, keyed by each file's identity.

An entry is valid while its file is unchanged: the key is the path with the file's
identity (:func:`inferscale.files.identity`: inode, size, times), so a
rewritten index (a new file renamed over the old) is read again. The cache holds at
most ``max_entries`` indexes and ``max_bytes`` of their files, the oldest dropped first.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from inferscale.errors import CorruptDataError
from inferscale import files
from inferscale.storage.index import UserIndex


class IndexCache:
    """Thread-safe; readers share it without the store's write lock."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[tuple, tuple[UserIndex, int]] = OrderedDict()  # key → (index, file bytes)
        self.nbytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def read(self, path: str, user_id: str, read: Callable[[Path, str], UserIndex]) -> UserIndex | None:
        """The index in ``path`` (None: no such file), from the cache while the file is unchanged,
        else ``read(path, user_id)``."""
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            return None
        key = (path, *files.identity(stat))
        with self._lock:
            if (hit := self._entries.get(key)) is not None:
                return hit[0]
        try:
            index = read(Path(path), user_id)
        except FileNotFoundError:
            return None
        except RecursionError:
            raise CorruptDataError(f"{path}: not a readable index (nested too deeply)") from None
        self._remember(key, index, stat.st_size)
        return index

    def _remember(self, key: tuple, index: UserIndex, size: int) -> None:
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = (index, size)
            self.nbytes += size
            while self._entries and (len(self._entries) > self.max_entries or self.nbytes > self.max_bytes):
                self.nbytes -= self._entries.popitem(last=False)[1][1]
