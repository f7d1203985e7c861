"""A volatile store (hbm/pinned) filled from the store of record, a whole user at a time.

The store of record (the disk store, Redis, a plugin's) is the source of truth and the only one
writers write; the memory store is a cache of whole users. :func:`ensure_user` makes the memory
store hold the record's current version of a user, told by the user's epoch (renewed by every
write, read from the user's index), not by comparing facts: a fact re-encoded under the same
token ids is a new version too. The facts reach the memory store in the form it keeps (its
``kv_dtype_at_rest``; a memory tier that names none gets them in the model's dtype), whatever
form the store of record keeps.
"""

from __future__ import annotations

from inferscale.errors import CapacityError, UnknownUserError
from inferscale.kv_fp8 import MODEL, all_at_rest
from inferscale.storage.base import KVStore
from inferscale.storage.tiers.memory import MemoryTier
from inferscale.storage.tiers.record import StoreOfRecord


def ensure_user(memory: MemoryTier | KVStore, record: StoreOfRecord, user_id: str) -> bool:
    """Load the user from the store of record into ``memory`` unless it holds the record's
    current version; True if it loaded. A user gone from the record is dropped from memory.

    A store that is not volatile (a store of record itself) is left alone. Two
    callers racing both load the same version, which is harmless. A user larger
    than ``memory`` could ever hold is refused (:class:`CapacityError`) from the
    size its index states, before a byte of K/V is read.
    """
    if not memory.volatile:
        return False
    current = record.epoch(user_id)
    if current is not None and memory.epoch(user_id) == current:
        return False
    try:
        memory.check_room(user_id, record.nbytes(user_id))
    except CapacityError:
        memory.delete(user_id)  # no stale copy stays
        raise
    try:
        epoch, facts = record.read_user(user_id)
    except UnknownUserError:
        memory.delete(user_id)
        return False
    memory.load(user_id, all_at_rest(facts, getattr(memory, "kv_dtype_at_rest", MODEL)), epoch)
    return True
