"""A volatile store (hbm/pinned) fronted by the disk store.

The disk store is the source of truth; the memory store is a cache of whole
users. Invariant: when the memory store has a user, it has all of that user's
facts on disk. :func:`ensure_user` loads a user on first use; writers go
through :func:`put_through` / :func:`delete_through` to keep the invariant.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from inferscale.errors import UnknownUserError
from inferscale.kv import FactKV
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


def put_through(memory: KVStore, disk: DiskStore, user_id: str, facts: Mapping[str, FactKV]) -> None:
    """Persist ``facts``; update ``memory`` only if it already holds the user."""
    disk.put(user_id, facts)
    if memory.has_user(user_id):
        memory.put(user_id, facts)


def delete_through(memory: KVStore, disk: DiskStore, user_id: str, fact_ids: Sequence[str] | None = None) -> None:
    """Delete from disk, then from ``memory``."""
    disk.delete(user_id, fact_ids)
    memory.delete(user_id, fact_ids)
