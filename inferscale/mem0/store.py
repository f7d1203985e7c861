"""A Mem0 vector store backed by any InferScale :class:`Retriever` (exact, faiss, Jasper).

Mem0 has no public registry for third-party stores, so attach one to a built
``mem0.Memory``::

    from inferscale.retrieval.exact import ExactRetriever
    from inferscale.mem0.store import attach

    memory = mem0.Memory.from_config({...})         # its own store only holds mem0's defaults
    store = attach(memory, ExactRetriever())        # memory.vector_store = the adapter

Each memory is indexed under the retriever user of its payload's ``user_id``
(``"_shared"`` when there is none), so a search filtered by ``user_id`` is one
per-user top-k, and the isolation of users is the retriever's. Other filters
(``agent_id``, ``run_id``, any metadata key) are applied to payloads, fetching
more hits until ``top_k`` pass or the user is exhausted. Filter values are
matched by equality, or membership for a list; operator filters (``{"gte": ..}``,
``AND``/``OR``/``NOT``) raise ``ValueError``. Mem0 is never imported at module
import time.

Payloads and vectors are kept in memory (vectors so that ``update`` can move a
memory to another user). With ``files`` (a :class:`CollectionFiles`), every
change is written to the changed users' files before the call returns, and a
new adapter over the same files starts with what they hold, indexed again.
Mem0's ``Memory.from_config`` builds such an adapter for provider
``"inferscale"`` once :func:`inferscale.mem0.register` has run.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inferscale.retrieval.base import Hit, Retriever
from inferscale.mem0.collection_files import CollectionFiles, UserMemories

SHARED = "_shared"
_LOGICAL = {"AND", "OR", "NOT", "$and", "$or", "$not"}


@dataclass
class MemoryRow:
    """What Mem0 reads from a store's results: ``id``, ``score`` (higher is better), ``payload``."""

    id: str
    score: float | None
    payload: dict


def attach(memory: Any, retriever: Retriever, dim: int | None = None) -> RetrieverVectorStore:
    """Make ``retriever`` the vector store of a built ``mem0.Memory``; returns the adapter."""
    store = make_store(retriever, getattr(memory, "collection_name", "mem0"), dim)
    memory.vector_store = store
    return store


def make_store(retriever: Retriever, collection_name: str = "mem0", dim: int | None = None,
               files: CollectionFiles | None = None) -> RetrieverVectorStore:
    """An adapter instance (a subclass of Mem0's ``VectorStoreBase``, imported here)."""
    return _store_class()(retriever, collection_name, dim, files)


def _store_class() -> type:
    try:
        from mem0.vector_stores.base import VectorStoreBase
    except ImportError as exc:
        raise ImportError("the Mem0 adapter needs mem0: pip install mem0ai==2.2.1") from exc
    return type("InferScaleVectorStore", (RetrieverVectorStore, VectorStoreBase), {})


class RetrieverVectorStore:
    """Mem0's 11 vector-store methods over a Retriever (see the module docstring)."""

    def __init__(self, retriever: Retriever, collection_name: str = "mem0", dim: int | None = None,
                 files: CollectionFiles | None = None):
        self.retriever, self.collection_name, self.dim, self.files = retriever, collection_name, dim, files
        self._payloads: dict[str, dict] = {}
        self._vectors: dict[str, torch.Tensor] = {}
        self._owner: dict[str, str] = {}  # memory id → retriever user
        self._members: dict[str, dict[str, None]] = {}  # retriever user → its memory ids, in insertion order
        self._lock = threading.RLock()
        if files is not None:
            for user in files.load():
                self._load(user)

    # -- collections (one per adapter)
    def create_col(self, name: str, vector_size: int | None = None, distance: str | None = None):
        self.collection_name, self.dim = name, vector_size or self.dim
        return self

    def list_cols(self) -> list[str]:
        return [self.collection_name]

    def delete_col(self) -> None:
        with self._lock:
            for user in list(self._members):
                self.retriever.delete(user)
            self._payloads.clear()
            self._vectors.clear()
            self._owner.clear()
            self._members.clear()
            if self.files is not None:
                self.files.remove_all()

    def reset(self) -> None:
        self.delete_col()

    def col_info(self) -> dict:
        return {"name": self.collection_name, "count": len(self._payloads), "dimension": self.dim}

    # -- rows
    def insert(self, vectors: Sequence[Sequence[float]], payloads: Sequence[dict] | None = None,
               ids: Sequence[str] | None = None) -> None:
        with self._lock:
            x = self._checked(vectors, fix=True)
            ids = [str(i) for i in ids] if ids is not None else [str(uuid.uuid4()) for _ in range(len(x))]
            payloads = [dict(p or {}) for p in payloads] if payloads is not None else [{} for _ in ids]
            if not len(x) == len(ids) == len(payloads):
                raise ValueError(f"got {len(x)} vectors, {len(payloads)} payloads and {len(ids)} ids")
            changed = {user for i, (memory_id, payload) in enumerate(zip(ids, payloads))
                       for user in self._put(memory_id, x[i], payload)}
            self._save(changed)

    def update(self, vector_id: str, vector: Sequence[float] | None = None, payload: dict | None = None) -> None:
        with self._lock:
            if vector_id not in self._payloads:
                raise ValueError(f"memory {vector_id!r} not found")
            new_vector = self._vectors[vector_id] if vector is None else self._checked([vector])[0]
            new_payload = dict(payload) if payload is not None else self._payloads[vector_id]
            self._save(self._put(vector_id, new_vector, new_payload))

    def delete(self, vector_id: str) -> None:
        with self._lock:
            user = self._owner.pop(vector_id, None)
            if user is not None:
                self.retriever.delete(user, [vector_id])
                del self._payloads[vector_id], self._vectors[vector_id], self._members[user][vector_id]
                self._save({user})

    def get(self, vector_id: str) -> MemoryRow | None:
        payload = self._payloads.get(vector_id)
        return None if payload is None else MemoryRow(vector_id, None, dict(payload))

    def list(self, filters: Mapping[str, Any] | None = None, top_k: int | None = 100) -> list[list[MemoryRow]]:
        with self._lock:
            rows = [MemoryRow(i, None, dict(p)) for i, p in self._payloads.items() if _matches(p, filters)]
            return [rows if top_k is None else rows[:top_k]]

    def search(self, query: Any, vectors: Sequence, top_k: int = 5, filters: Mapping[str, Any] | None = None
               ) -> list[MemoryRow]:
        """Top ``top_k`` memories for one query vector, higher score = more similar."""
        with self._lock:
            q = self._checked(vectors)[:1]
            hits = [h for user in self._users(filters) for h in self._search_user(user, q, top_k, filters)]
            hits.sort(key=lambda h: (-h.score, h.fact_id))
            return [MemoryRow(h.fact_id, h.score, dict(self._payloads[h.fact_id])) for h in hits[:top_k]]

    # -- helpers
    def _put(self, memory_id: str, vector: torch.Tensor, payload: dict) -> set[str]:
        """Index one memory under its payload's user; the users whose memories changed."""
        user = str(payload.get("user_id") or SHARED)
        old = self._owner.get(memory_id)
        if old is not None and old != user:
            self.retriever.delete(old, [memory_id])
            del self._members[old][memory_id]
        self.retriever.add(user, [memory_id], vector[None])
        self._owner[memory_id], self._payloads[memory_id], self._vectors[memory_id] = user, payload, vector
        self._members.setdefault(user, {})[memory_id] = None
        return {user} if old is None or old == user else {user, old}

    def _load(self, user: UserMemories) -> None:
        """Index a user's stored memories (the file's vectors as they were written)."""
        self._checked(user.vectors, fix=True)
        rows = [i for i, (m, p) in enumerate(zip(user.ids, user.payloads)) if self._supersedes(m, p)]
        if rows:
            self.retriever.add(user.user_id, [user.ids[i] for i in rows], user.vectors[rows])
        for i in rows:
            memory_id = user.ids[i]
            self._owner[memory_id], self._payloads[memory_id] = user.user_id, user.payloads[i]
            self._vectors[memory_id] = user.vectors[i]
            self._members.setdefault(user.user_id, {})[memory_id] = None

    def _supersedes(self, memory_id: str, payload: dict) -> bool:
        """Whether a stored copy wins over one already loaded: two copies exist only when a crash
        came between the two writes of a move to another user; the later ``updated_at`` wins."""
        old = self._owner.get(memory_id)
        if old is None:
            return True
        if str(payload.get("updated_at") or "") <= str(self._payloads[memory_id].get("updated_at") or ""):
            return False
        self.retriever.delete(old, [memory_id])
        del self._members[old][memory_id]
        return True

    def _save(self, users: set[str]) -> None:
        if self.files is None:
            return
        for user in sorted(users):
            ids = list(self._members.get(user, ()))
            vectors = torch.stack([self._vectors[i] for i in ids]) if ids else torch.empty(0, self.dim or 0)
            self.files.save(UserMemories(user, ids, vectors, [self._payloads[i] for i in ids]))
            if not ids:
                self._members.pop(user, None)

    def _checked(self, vectors: Sequence | torch.Tensor, fix: bool = False) -> torch.Tensor:
        """``[n, dim]`` float32; a clear error when the width is not the collection's
        (with ``fix``, a collection of no fixed width takes this one)."""
        x = _matrix(vectors)
        if self.dim is None and fix:
            self.dim = int(x.shape[-1])
        if self.dim is not None and x.shape[-1] != self.dim:
            raise ValueError(f"collection {self.collection_name!r} holds {self.dim}-d vectors, got {x.shape[-1]}-d "
                             "(set the vector store's embedding_model_dims to the embedder's width)")
        return x

    def _users(self, filters: Mapping[str, Any] | None) -> list[str]:
        wanted = (filters or {}).get("user_id")
        known = sorted(u for u, members in self._members.items() if members)
        if wanted is None:
            return known
        wanted = [wanted] if isinstance(wanted, str) else list(wanted)
        return [u for u in known if u in {str(w) for w in wanted}]

    def _search_user(self, user: str, q: torch.Tensor, top_k: int, filters: Mapping[str, Any] | None) -> list[Hit]:
        """Fetch ×4 more until ``top_k`` hits pass the payload filters or the user has no more."""
        count, fetch = self.retriever.count(user), top_k
        while True:
            hits = [h for h in self.retriever.search(user, q, fetch)[0] if _matches(self._payloads[h.fact_id], filters)]
            if len(hits) >= top_k or fetch >= count:
                return hits[:top_k]
            fetch = min(count, fetch * 4)


def _matrix(vectors: Sequence) -> torch.Tensor:
    x = torch.as_tensor(vectors, dtype=torch.float32)
    return x[None] if x.ndim == 1 else x


def _matches(payload: Mapping[str, Any], filters: Mapping[str, Any] | None) -> bool:
    """Equality, or membership for list values; ``None`` values are ignored."""
    for key, value in (filters or {}).items():
        if key in _LOGICAL or isinstance(value, Mapping):
            raise ValueError(f"the InferScale Mem0 store supports equality filters only, got {key!r}: {value!r}")
        if value is None:
            continue
        if isinstance(value, (list, tuple, set)):
            if payload.get(key) not in value:
                return False
        elif payload.get(key) != value:
            return False
    return True
