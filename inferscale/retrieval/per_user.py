"""What the built-in retrievers share: one index per user, behind one lock."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from inferscale.retrieval.base import Retriever
from inferscale.retrieval.checks import DimLock, check_fact_ids, last_wins


class PerUserRetriever(Retriever):
    """Keeps ``self._users[user_id]``: an index with ``remove(fact_ids)`` and ``len()``.

    Users never share an index, so a search can only ever return the user's own facts.
    """

    def __init__(self, dim: int | None):
        self._dims = DimLock(dim)
        self._users: dict[str, Any] = {}
        self._lock = threading.RLock()

    def _rows(self, fact_ids: Sequence[str], embeddings: torch.Tensor) -> tuple[list[str], torch.Tensor]:
        """The checked ids and rows of an ``add`` (the width fixed by the first), the last of a repeated id kept."""
        x = self._dims.matrix(embeddings, "embeddings", fix=True)
        return last_wins(check_fact_ids(fact_ids, x.shape[0]), x)

    def delete(self, user_id: str, fact_ids: Sequence[str] | None = None) -> None:
        with self._lock:
            if fact_ids is None:
                self._users.pop(user_id, None)
            elif user_id in self._users:
                self._users[user_id].remove(check_fact_ids(fact_ids, len(fact_ids)))

    def count(self, user_id: str) -> int:
        with self._lock:
            user = self._users.get(user_id)
            return 0 if user is None else len(user)
