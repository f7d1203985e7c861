"""A Mem0 vector store backed by any InferScale :class:`Retriever` (exact, faiss, Jasper).

Mem0 has no public registry for third-party stores, so attach one to a built
``mem0.Memory``::

    from inferscale.retrieval.exact import ExactRetriever
    from inferscale.mem0.store import attach

    memory = mem0.Memory.from_config({...})         # its own store only holds mem0's defaults
    store = attach(memory, ExactRetriever())        # memory.vector_store = the adapter

Each memory is indexed under the retriever user of its payload's ``user_id``
(``"_shared"`` when there is none), so a search filtered by ``user_id`` is one
per-user top-k, and the isolation of users is the retriever's. Mem0's whole
filter language works, with the results Mem0's Qdrant store gives (the read
side: :mod:`~inferscale.mem0.reading`). Scores are cosine similarities by
default (vectors and queries are normalized, as Qdrant does); with
``distance="dot"``, inner products of the vectors as given. Every write is
checked whole (widths, payloads as JSON, user ids) before anything is indexed.
Mem0 is never imported at module import time.

Payloads and vectors are kept in memory (vectors so that ``update`` can move a
memory to another user). With ``files`` (a :class:`CollectionFiles`), every
change is written to the changed users' files before the call returns, and a
new adapter over the same files starts with what they hold, indexed again. A
user whose file is unreadable is left out, with a warning: a call naming that
user (a filter on its ``user_id``, a write) raises :class:`CorruptDataError`,
and every other user is served. Mem0's ``Memory.from_config`` builds such an
adapter for provider ``"inferscale"`` once :func:`inferscale.mem0.register` has run.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from inferscale.facts import check_user_id
from inferscale.mem0.collection_files import CollectionFiles, Unreadable, UserMemories
from inferscale.mem0.payload_values import jsonable
from inferscale.mem0.reading import CollectionReads, MemoryRow  # noqa: F401  (MemoryRow: what Mem0 reads)
from inferscale.mem0.scopes import Scopes
from inferscale.retrieval.base import Retriever

logger = logging.getLogger(__name__)

SHARED = "_shared"
DISTANCES = ("cosine", "dot")


def attach(memory: Any, retriever: Retriever, dim: int | None = None) -> RetrieverVectorStore:
    """Make ``retriever`` the vector store of a built ``mem0.Memory``; returns the adapter."""
    store = make_store(retriever, getattr(memory, "collection_name", "mem0"), dim)
    memory.vector_store = store
    return store


def make_store(retriever: Retriever, collection_name: str = "mem0", dim: int | None = None,
               files: CollectionFiles | None = None, distance: str = "cosine") -> RetrieverVectorStore:
    """An adapter instance (a subclass of Mem0's ``VectorStoreBase``, imported here)."""
    return _store_class()(retriever, collection_name, dim, files, distance)


def _store_class() -> type:
    try:
        from mem0.vector_stores.base import VectorStoreBase
    except ImportError as exc:
        raise ImportError("the Mem0 adapter needs mem0: pip install mem0ai==2.2.1") from exc
    return type("InferScaleVectorStore", (RetrieverVectorStore, VectorStoreBase), {})


class RetrieverVectorStore(CollectionReads):
    """Mem0's 11 vector-store methods over a Retriever (see the module docstring); the reads are
    :class:`~inferscale.mem0.reading.CollectionReads`'."""

    def __init__(self, retriever: Retriever, collection_name: str = "mem0", dim: int | None = None,
                 files: CollectionFiles | None = None, distance: str = "cosine"):
        if distance not in DISTANCES:
            raise ValueError(f"distance must be one of {', '.join(DISTANCES)} (retrievers rank by inner "
                             f"product), got {distance!r}")
        self.retriever, self.collection_name, self.dim, self.files = retriever, collection_name, dim, files
        self.distance = distance
        self._payloads: dict[str, dict] = {}
        self._vectors: dict[str, torch.Tensor] = {}
        self._owner: dict[str, str] = {}  # memory id → retriever user
        self._members: dict[str, dict[str, None]] = {}  # retriever user → its memory ids, in insertion order
        self._scopes = Scopes()
        self._unreadable: dict[str, str] = {}  # user → why their file could not be read
        self._lock = threading.RLock()
        if files is not None:
            for user in files.load():
                self._load(user)

    # -- collections (one per adapter)
    def create_col(self, name: str, vector_size: int | None = None, distance: Any = None):
        """This store's own collection (it holds one); anything else is an error saying what to do."""
        if name != self.collection_name:
            raise ValueError(f"this store holds collection {self.collection_name!r}, one collection a store: for "
                             f"{name!r}, build another with collection_name={name!r}")
        if vector_size is not None and self.dim is not None and vector_size != self.dim:
            raise ValueError(f"collection {name!r} holds {self.dim}-d vectors, not {vector_size}-d "
                             "(set the vector store's embedding_model_dims to the embedder's width)")
        wanted = str(getattr(distance, "value", distance)).lower() if distance is not None else self.distance
        if wanted != self.distance:
            raise ValueError(f"collection {name!r} scores by {self.distance}, not {wanted}: set the vector "
                             f"store's distance ({', '.join(DISTANCES)})")
        self.dim = self.dim or vector_size
        return self

    def list_cols(self) -> list[str]:
        return [self.collection_name]

    def delete_col(self) -> None:
        with self._lock:
            for user in list(self._members):
                self.retriever.delete(user)
            for held in (self._payloads, self._vectors, self._owner, self._members, self._unreadable):
                held.clear()
            self._scopes.clear()
            if self.files is not None:
                self.files.remove_all()

    def reset(self) -> None:
        self.delete_col()

    def col_info(self) -> dict:
        return {"name": self.collection_name, "count": len(self._payloads), "dimension": self.dim,
                "distance": self.distance}

    # -- rows
    def insert(self, vectors: Sequence[Sequence[float]], payloads: Sequence[dict] | None = None,
               ids: Sequence[str] | None = None) -> None:
        """Add or replace memories; everything is checked (widths, payloads, user ids) before any is indexed."""
        with self._lock:
            if len(vectors) == 0:
                return
            x = self._checked(vectors)
            ids = [str(i) for i in ids] if ids is not None else [str(uuid.uuid4()) for _ in range(len(x))]
            payloads = [jsonable(p) for p in payloads] if payloads is not None else [{} for _ in ids]
            if not len(x) == len(ids) == len(payloads):
                raise ValueError(f"got {len(x)} vectors, {len(payloads)} payloads and {len(ids)} ids")
            users = [self._user_of(p) for p in payloads]
            self._refuse_unreadable(users)
            self._fix_dim(x)
            added: dict[str, dict[str, torch.Tensor]] = {}
            changed = set()
            for memory_id, vector, payload, user in zip(ids, self._prepared(x), payloads, users):
                changed |= self._place(memory_id, payload, user, vector, added)
            for user, rows in added.items():
                if rows:
                    self.retriever.add(user, list(rows), torch.stack(list(rows.values())))
            self._save(changed)

    def update(self, vector_id: str, vector: Sequence[float] | None = None, payload: dict | None = None) -> None:
        """Replace a memory's vector, its payload, or both; a payload alone is merged into the stored one
        (Qdrant's ``set_payload``)."""
        with self._lock:
            vector_id = str(vector_id)
            if vector_id not in self._payloads:
                raise ValueError(f"memory {vector_id!r} not found")
            if vector is None and payload is None:
                return
            new_vector = self._vectors[vector_id] if vector is None else self._prepared(self._checked([vector]))[0]
            new_payload = self._payloads[vector_id] if payload is None else jsonable(payload)
            if vector is None and payload is not None:
                new_payload = {**self._payloads[vector_id], **new_payload}
            user = self._user_of(new_payload)
            self._refuse_unreadable([user])
            changed = self._place(vector_id, new_payload, user, new_vector, {})
            self.retriever.add(user, [vector_id], new_vector[None])
            self._save(changed)

    def delete(self, vector_id: str) -> None:
        with self._lock:
            user = self._owner.pop(str(vector_id), None)
            if user is not None:
                vector_id = str(vector_id)
                self.retriever.delete(user, [vector_id])
                self._scopes.remove(user, self._payloads[vector_id])
                del self._payloads[vector_id], self._vectors[vector_id], self._members[user][vector_id]
                self._save({user})

    # -- where memories are
    def _user_of(self, payload: dict) -> str:
        """The retriever user a memory goes to: its ``user_id``, checked, or :data:`SHARED` without one."""
        user = payload.get("user_id")
        if user is None:
            return SHARED
        if user == SHARED:
            raise ValueError(f"user_id {SHARED!r} names where memories without a user_id are kept: choose another")
        return check_user_id(user)

    def _place(self, memory_id: str, payload: dict, user: str, vector: torch.Tensor,
               added: dict[str, dict[str, torch.Tensor]]) -> set[str]:
        """Record a memory under ``user`` (its vector to be indexed from ``added``); the users changed."""
        old = self._owner.get(memory_id)
        if old is not None:
            self._scopes.remove(old, self._payloads[memory_id])
            if old != user:
                self.retriever.delete(old, [memory_id])
                del self._members[old][memory_id]
                added.get(old, {}).pop(memory_id, None)
        self._owner[memory_id], self._payloads[memory_id], self._vectors[memory_id] = user, payload, vector
        self._members.setdefault(user, {})[memory_id] = None
        self._scopes.add(user, payload)
        added.setdefault(user, {})[memory_id] = vector
        return {user} if old is None or old == user else {user, old}

    # -- files
    def _load(self, user: UserMemories | Unreadable) -> None:
        """Index a user's stored memories (or note the user as unreadable)."""
        owner = None if isinstance(user, Unreadable) or user.user_id == SHARED else user.user_id
        if not isinstance(user, Unreadable) and any(p.get("user_id") != owner for p in user.payloads):
            user = Unreadable(user.user_id, f"users/{self.files.path(user.user_id).name}: holds a memory whose "
                                            f"user_id is not {owner!r}")
        if isinstance(user, Unreadable):
            self._unreadable[user.user_id] = user.reason
            logger.warning("Mem0 collection %r: the memories of user %r are left out: %s", self.collection_name,
                           user.user_id, user.reason)
            return
        x = self._prepared(self._checked(user.vectors))
        self._fix_dim(x)
        rows = [i for i, (m, p) in enumerate(zip(user.ids, user.payloads)) if self._supersedes(m, p)]
        if rows:
            self.retriever.add(user.user_id, [user.ids[i] for i in rows], x[rows])
        for i in rows:
            memory_id, payload = user.ids[i], user.payloads[i]
            self._owner[memory_id], self._payloads[memory_id], self._vectors[memory_id] = user.user_id, payload, x[i]
            self._members.setdefault(user.user_id, {})[memory_id] = None
            self._scopes.add(user.user_id, payload)

    def _supersedes(self, memory_id: str, payload: dict) -> bool:
        """Whether a stored copy wins over one already loaded: two copies exist only when a crash
        came between the two writes of a move to another user; the later ``updated_at`` wins."""
        old = self._owner.get(memory_id)
        if old is None:
            return True
        if str(payload.get("updated_at") or "") <= str(self._payloads[memory_id].get("updated_at") or ""):
            return False
        self.retriever.delete(old, [memory_id])
        self._scopes.remove(old, self._payloads[memory_id])
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

    # -- vectors
    def _checked(self, vectors: Sequence | torch.Tensor) -> torch.Tensor:
        """``[n, dim]`` float32, finite, of the collection's width (any width while it has none)."""
        x = torch.as_tensor(vectors, dtype=torch.float32)
        x = x[None] if x.ndim == 1 else x
        if x.ndim != 2:
            raise ValueError(f"vectors must be one vector or a list of vectors, got shape {tuple(x.shape)}")
        if self.dim is not None and x.shape[-1] != self.dim:
            raise ValueError(f"collection {self.collection_name!r} holds {self.dim}-d vectors, got {x.shape[-1]}-d "
                             "(set the vector store's embedding_model_dims to the embedder's width)")
        if not torch.isfinite(x).all():
            raise ValueError("vectors must be finite (no NaN or infinity)")
        return x

    def _fix_dim(self, x: torch.Tensor) -> None:
        """A collection of no fixed width takes that of its first vectors."""
        if self.dim is None:
            self.dim = int(x.shape[-1])

    def _prepared(self, x: torch.Tensor) -> torch.Tensor:
        """Unit vectors for cosine (a zero vector stays zero, as on Qdrant); as given for dot."""
        return torch.nn.functional.normalize(x, dim=-1) if self.distance == "cosine" else x
