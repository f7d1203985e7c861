"""Retriever and Embedder interfaces."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from inferscale.facts import Hit  # noqa: F401  (re-exported: retrievers return Hits)


class Retriever(ABC):
    """Top-k search over one user's fact embeddings (users never see each other's facts).

    Scores are inner products of the vectors as given; embedders return unit
    vectors, so scores are cosine similarities.
    """

    name: ClassVar[str]

    @abstractmethod
    def add(self, user_id: str, fact_ids: Sequence[str], embeddings: torch.Tensor) -> None:
        """Index ``embeddings[i]`` (shape ``[n, dim]``) under ``fact_ids[i]``; re-adding an id replaces it."""

    @abstractmethod
    def search(self, user_id: str, queries: torch.Tensor, k: int) -> list[list[Hit]]:
        """For each query row (``[q, dim]``), up to ``k`` hits, best first. Unknown user: ``[]`` each."""

    @abstractmethod
    def delete(self, user_id: str, fact_ids: Sequence[str] | None = None) -> None:
        """Remove some facts of a user, or all of them."""

    @abstractmethod
    def count(self, user_id: str) -> int:
        """How many facts the user has indexed."""


class Embedder(ABC):
    """Text → unit vectors, ``[n, dim]`` float32 on CPU."""

    name: ClassVar[str]

    @property
    @abstractmethod
    def dim(self) -> int: ...

    @abstractmethod
    def embed(self, texts: Sequence[str]) -> torch.Tensor: ...
