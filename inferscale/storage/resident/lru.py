"""The order in which a memory store's users were last used, for LRU eviction."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable


class UsageOrder:
    """Users from least to most recently used; thread-safe (``get`` touches
    users without the store's write lock)."""

    def __init__(self):
        self._order: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, user_id: str) -> None:
        """A user just stored: the most recently used."""
        with self._lock:
            self._order[user_id] = None
            self._order.move_to_end(user_id)

    def touch(self, user_id: str) -> None:
        """A user just read (ignored unless held: a read may race its eviction)."""
        with self._lock:
            if user_id in self._order:
                self._order.move_to_end(user_id)

    def forget(self, user_id: str) -> None:
        with self._lock:
            self._order.pop(user_id, None)

    def oldest(self, spare: Callable[[str], bool]) -> str | None:
        """The least recently used user that ``spare`` does not protect, or None."""
        with self._lock:
            return next((u for u in self._order if not spare(u)), None)
