"""What the GPU graph retrievers (Jasper, CAGRA) share: a graph per user, derived from its matrix.

* Storage. Each user's vectors live in a float32 :class:`UserMatrix` on the device; that
  matrix is the source of truth and the graph is derived from it.
* Changes. ``add`` and ``delete`` only change the matrix and drop the user's graph; the
  next ``search`` rebuilds it from the current rows (a burst of adds costs one rebuild).
  Both libraries give a freshly built graph the ids ``0..n-1`` in row order, so an id is a row.
* Small users. Users below ``min_graph_size`` facts (or whose wanted candidates exceed what
  the graph can return) are searched exactly, as :class:`ExactRetriever` does.
* Scores. With ``rescore`` the graph is asked for ``rerank_factor·k`` candidates, re-scored in
  float32 against the stored rows: exact inner products in the shared order (ties by
  ``fact_id``), comparable with every other backend. Without it, the backend turns its own
  distances into inner products.

A subclass names its ``Options`` (with the fields used here) and implements ``build_graph``,
``graph_candidates``, ``max_candidates`` and ``min_nodes``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from inferscale.retrieval.base import Hit
from inferscale.retrieval.checks import check_k
from inferscale.retrieval.per_user import PerUserRetriever
from inferscale.retrieval.ranking import sort_hits, top_hits
from inferscale.retrieval.user_matrix import UserMatrix


class GraphRetriever(PerUserRetriever):
    """Graph ANN search per user on the device, exact search for small users."""

    def __init__(self, options: Any):
        self.options = options
        self.device = torch.device(options.device)
        super().__init__(options.dim)
        self._graphs: dict[str, Any] = {}  # user_id → a graph of the user's current rows

    # ---------------------------------------------------------------- what a backend provides

    @abstractmethod
    def build_graph(self, vectors: torch.Tensor) -> Any:
        """A graph over ``vectors`` (float32 ``[n, dim]`` on ``self.device``), ids = rows."""

    @abstractmethod
    def graph_candidates(self, graph: Any, q: torch.Tensor, wanted: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, scores)``, each ``[q, wanted]``: candidate rows (invalid ones < 0 or ≥ n) and
        their inner products estimated from the graph's own distances."""

    @abstractmethod
    def max_candidates(self) -> int:
        """The most candidates one graph search can return."""

    @abstractmethod
    def min_nodes(self) -> int:
        """The fewest rows the library builds a graph of."""

    # ---------------------------------------------------------------- Retriever

    def add(self, user_id: str, fact_ids: Sequence[str], embeddings: torch.Tensor) -> None:
        with self._lock:
            ids, x = self._rows(fact_ids, embeddings)
            if not ids:
                return
            self._users.setdefault(user_id, UserMatrix(self._dims.dim, self.device)).upsert(ids, x)
            self._graphs.pop(user_id, None)

    def delete(self, user_id: str, fact_ids: Sequence[str] | None = None) -> None:
        with self._lock:
            self._graphs.pop(user_id, None)
            super().delete(user_id, fact_ids)

    def search(self, user_id: str, queries: torch.Tensor, k: int) -> list[list[Hit]]:
        with self._lock:
            q = self._dims.matrix(queries, "queries", fix=False).to(self.device, torch.float32)
            check_k(k)
            user = self._users.get(user_id)
            if user is None or len(user) == 0 or k == 0:
                return [[] for _ in range(q.shape[0])]
            k = min(k, len(user))
            wanted = min(len(user), k * (self.options.rerank_factor if self.options.rescore else 1))
            if len(user) < max(self.options.min_graph_size, self.min_nodes()) or wanted > self.max_candidates():
                return top_hits(q @ user.vectors.T, user.fact_ids, k)
            return self._graph_search(user_id, user, q, k, wanted)

    def _graph_search(self, user_id: str, user: UserMatrix, q: torch.Tensor, k: int, wanted: int) -> list[list[Hit]]:
        if user_id not in self._graphs:
            self._graphs[user_id] = self.build_graph(user.vectors)
        rows, scores = self.graph_candidates(self._graphs[user_id], q, wanted)
        rows = rows.long()
        valid = (rows >= 0) & (rows < len(user))
        rows = rows.clamp(0, len(user) - 1)
        if self.options.rescore:
            scores = torch.einsum("qd,qcd->qc", q, user.vectors[rows])
        return [
            sort_hits(_pairs(user.fact_ids, r_row, s_row, ok_row), k)
            for r_row, s_row, ok_row in zip(rows.tolist(), scores.float().tolist(), valid.tolist())
        ]


def _pairs(fact_ids: list[str], rows: list[int], scores: list[float], valid: list[bool]) -> list[tuple[float, str]]:
    """``(score, fact_id)`` of the valid candidates, each row once."""
    seen: dict[int, float] = {}
    for row, score, ok in zip(rows, scores, valid):
        if ok:
            seen.setdefault(row, score)
    return [(score, fact_ids[row]) for row, score in seen.items()]
