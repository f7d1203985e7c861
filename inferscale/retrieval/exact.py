"""Exact top-k: one matrix per user, a matmul and a top-k, on the GPU when there is one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from inferscale.devices import auto_device, check_device
from inferscale.retrieval.base import Hit
from inferscale.retrieval.per_user import PerUserRetriever
from inferscale.retrieval.ranking import top_hits
from inferscale.retrieval.checks import check_k, require_finite
from inferscale.retrieval.user_matrix import UserMatrix


class ExactRetriever(PerUserRetriever):
    """Brute-force inner-product search; exact, and fast up to ~10⁵ facts per user.

    Ties are broken by ``fact_id`` (see :mod:`inferscale.retrieval.ranking`).
    """

    name: ClassVar[str] = "exact"

    @dataclass(frozen=True)
    class Options:
        #: ``None``: the runtime ``device`` if given, else CUDA when available, else CPU.
        device: str | None = None
        #: Expected embedding width; ``None``: fixed by the first ``add``.
        dim: int | None = None

        def __post_init__(self):
            check_device(self.device)

    def __init__(self, options: Options | None = None, *, device: str | torch.device | None = None, **runtime: Any):
        """``runtime`` objects other than ``device`` are accepted and ignored (the index lives in memory)."""
        self.options = options or self.Options()
        self.device = auto_device(self.options.device or device)
        super().__init__(self.options.dim)

    def add(self, user_id: str, fact_ids: Sequence[str], embeddings: torch.Tensor) -> None:
        with self._lock:
            ids, x = self._rows(fact_ids, embeddings)
            if ids:
                self._user(user_id).upsert(ids, x)

    def search(self, user_id: str, queries: torch.Tensor, k: int) -> list[list[Hit]]:
        with self._lock:
            q = self._dims.matrix(queries, "queries", fix=False, finite=False)  # checked in top_hits
            check_k(k)
            user = self._users.get(user_id)
            if user is None or len(user) == 0:
                require_finite(q, "queries")
                return [[] for _ in range(q.shape[0])]
            q = q.to(self.device, torch.float32)
            return top_hits(q @ user.vectors.T, user.fact_ids, k, queries=q)


    def _user(self, user_id: str) -> UserMatrix:
        if user_id not in self._users:
            self._users[user_id] = UserMatrix(self._dims.dim, self.device)
        return self._users[user_id]
