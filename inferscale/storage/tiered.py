"""A volatile store (hbm/pinned) fronted by the disk store.

The disk store is the source of truth and the only one writers write; the
memory store is a cache of whole users. :func:`ensure_user` loads a user on
first use. A reader that finds the cached facts differ from what it was asked
for (another process wrote to disk since) drops the user and loads it again
(``connector/loader.py``).
"""

from __future__ import annotations

from inferscale.errors import UnknownUserError
from inferscale.storage.base import KVStore
from inferscale.storage.disk import DiskStore


def ensure_user(memory: KVStore, disk: DiskStore, user_id: str) -> bool:
    """Load the user from disk into ``memory`` unless it is there; True if it loaded.

    A user on neither tier is left alone (False). Two callers racing both load
    the same facts, which is harmless (``put`` replaces).
    """
    if memory.has_user(user_id):
        return False
    try:
        facts = disk.load_user(user_id)
    except UnknownUserError:
        return False
    memory.put(user_id, facts)
    return True
