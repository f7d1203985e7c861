"""Each user's retrieval index kept at the store of record's version of them.

The retrieval index lives in the process that searches it; the facts live in the store of
record, which other processes (replicas behind a router, sharing a Redis store or a shared
filesystem) may write. Before a user's index is searched, :meth:`IndexedEpochs.sync` compares
the epoch it was built from with the store's (one small read) and rebuilds it from the stored
embeddings when they differ, so a fact added, changed or deleted through any replica is what
the next search on every replica sees.
"""

from __future__ import annotations

import threading


class IndexedEpochs:
    """The store's epoch each user's retrieval index was built from."""

    def __init__(self, store, retriever):
        self.store, self.retriever = store, retriever
        self._epochs: dict[str, str | None] = {}
        self._lock = threading.Lock()

    def note(self, user_id: str, epoch: str | None) -> None:
        """The user's index was built from (at least) version ``epoch``."""
        with self._lock:
            self._epochs[user_id] = epoch

    def sync(self, user_id: str):
        """The retriever, with ``user_id``'s index rebuilt first if the store holds another version."""
        epoch = self.store.epoch(user_id)
        with self._lock:
            if user_id in self._epochs and self._epochs[user_id] == epoch:
                return self.retriever
            self._rebuild(user_id, epoch)
        return self.retriever

    def _rebuild(self, user_id: str, epoch: str | None) -> None:
        ids, vectors = self.store.embeddings(user_id) if epoch is not None else ([], None)
        self.retriever.delete(user_id)
        if ids:
            self.retriever.add(user_id, ids, vectors)
        self._epochs[user_id] = epoch  # read before the embeddings: a newer version is read again next time
