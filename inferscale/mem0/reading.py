"""The read side of Mem0's vector store: ``get``, ``list`` and ``search`` under Mem0's filters.

A filter is compiled once (:mod:`~inferscale.mem0.filters`); its equalities and ``in`` on the
scope fields pick the retriever users visited (:mod:`~inferscale.mem0.scopes`), and each
visited user's memories are read against the rest of it. A search asks the retriever for
``OVERFETCH``× ``top_k`` hits and keeps those the filter selects; when too few pass (a selective
filter), it ranks every memory of the user that passes by its stored vector instead, so the
result is exact whatever the retriever. A listing is in id order, as Qdrant's scroll.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inferscale.errors import CorruptDataError
from inferscale.mem0.filters import Filter, compile_filters, narrowed, without_user_equalities
from inferscale.retrieval.base import Hit

#: hits fetched per wanted hit before a filtered search ranks every memory that passes
OVERFETCH = 4


@dataclass
class MemoryRow:
    """What Mem0 reads from a store's results: ``id``, ``score`` (higher is better), ``payload``."""

    id: str
    score: float | None
    payload: dict


class CollectionReads:
    """``get``, ``list``, ``search`` of :class:`~inferscale.mem0.store.RetrieverVectorStore` (whose state they read)."""

    def get(self, vector_id: str) -> MemoryRow | None:
        payload = self._payloads.get(str(vector_id))
        return None if payload is None else MemoryRow(str(vector_id), None, copy.deepcopy(payload))

    def list(self, filters: Mapping[str, Any] | None = None, top_k: int | None = 100) -> list[list[MemoryRow]]:
        """The memories the filters select, in id order (as Qdrant's scroll), at most ``top_k``."""
        with self._lock:
            where = compile_filters(filters)
            users, where = self._visited(where)
            ids = [m for user in users for m in self._members[user] if where is None or where.matches(self._payloads[m])]
            ids = sorted(ids) if top_k is None else heapq.nsmallest(max(top_k, 0), ids)
            return [[MemoryRow(i, None, copy.deepcopy(self._payloads[i])) for i in ids]]

    def search(self, query: Any, vectors: Sequence, top_k: int = 5, filters: Mapping[str, Any] | None = None
               ) -> list[MemoryRow]:
        """Top ``top_k`` memories the filters select, for one query vector; higher score = more similar."""
        with self._lock:
            q = self._prepared(self._checked(vectors)[:1])
            where = compile_filters(filters)
            if top_k <= 0:
                return []
            users, where = self._visited(where)
            hits = [h for user in users for h in self._search_user(user, q, top_k, where)]
            hits.sort(key=lambda h: (-h.score, h.fact_id))
            return [MemoryRow(h.fact_id, h.score, copy.deepcopy(self._payloads[h.fact_id])) for h in hits[:top_k]]

    def _visited(self, where: Filter | None) -> tuple[list[str], Filter | None]:
        """The users a filter can select memories of (an unreadable one it names: an error), and what is
        left of the filter to read on their payloads: not its equalities on ``user_id``, which every
        memory of a user visited passes (a memory's payload names the user it is indexed under)."""
        if where is None:
            return sorted(u for u, members in self._members.items() if members), None
        named = narrowed(where, lambda key, values: {v for kind, v in values if kind == "str"}
                         if key == "user_id" else None)
        self._refuse_unreadable(named or ())
        users = narrowed(where, self._scopes.users)
        visited = sorted(u for u in (self._members if users is None else users) if self._members.get(u))
        return visited, without_user_equalities(where)

    def _refuse_unreadable(self, users: Sequence[str] | set[str]) -> None:
        bad = sorted({u for u in users if u in self._unreadable})
        if bad:
            raise CorruptDataError(
                f"collection {self.collection_name!r}: the memories of user {bad[0]!r} are unreadable "
                f"({self._unreadable[bad[0]]}); forget the user (`inferscale forget USER` over this data dir, or "
                "MemoryAPI.delete_user) or put the file back from a backup, then try again")

    def _search_user(self, user: str, q: torch.Tensor, top_k: int, where: Filter | None) -> list[Hit]:
        """The user's top ``top_k`` hits that ``where`` selects: from ``OVERFETCH``× as many hits, or,
        when too few of those pass, from every memory of the user that passes (ranked exactly)."""
        if where is None:
            return self.retriever.search(user, q, top_k)[0]
        count = len(self._members[user])
        fetch = min(count, top_k * OVERFETCH)
        ranked = self.retriever.search(user, q, fetch)[0]
        hits = [h for h in ranked if where.matches(self._payloads[h.fact_id])]
        if len(hits) >= top_k or len(ranked) >= count:  # enough, or every memory of the user was ranked
            return hits[:top_k]
        return self._scan(user, q, top_k, where)

    def _scan(self, user: str, q: torch.Tensor, top_k: int, where: Filter) -> list[Hit]:
        ids = [m for m in self._members[user] if where.matches(self._payloads[m])]
        if not ids:
            return []
        scores = (torch.stack([self._vectors[m] for m in ids]) @ q[0]).tolist()
        best = heapq.nsmallest(top_k, zip(scores, ids), key=lambda s: (-s[0], s[1]))
        return [Hit(memory_id, score) for score, memory_id in best]

