"""Input checks and small tensor helpers shared by retrievers and embedders."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit L2 norm (all-zero rows stay zero), float32."""
    x = x.to(torch.float32)
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


def check_positive(value: object, what: str) -> None:
    """ValueError unless ``value`` is an ``int`` ≥ 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")


def check_texts(texts: Sequence[str]) -> list[str]:
    """A list of strings; a bare string is refused (it would embed per character)."""
    if isinstance(texts, str):
        raise TypeError("embed() takes a sequence of strings, not one string: use embed([text])")
    texts = list(texts)
    bad = [t for t in texts if not isinstance(t, str)]
    if bad:
        raise TypeError(f"embed() takes strings, got {type(bad[0]).__name__}")
    return texts


def check_fact_ids(fact_ids: Sequence[str], n: int) -> list[str]:
    """``n`` non-empty string ids."""
    if isinstance(fact_ids, str):
        raise TypeError("fact_ids must be a sequence of strings, not one string")
    ids = list(fact_ids)
    if len(ids) != n:
        raise ValueError(f"got {len(ids)} fact_ids for {n} embeddings")
    for fact_id in ids:
        if not isinstance(fact_id, str) or not fact_id:
            raise ValueError(f"fact_ids must be non-empty strings, got {fact_id!r}")
    return ids


def check_k(k: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k must be a non-negative integer, got {k!r}")


class DimLock:
    """Checks that every matrix a retriever sees has one width.

    The width is fixed by ``dim`` when given, else by the first matrix added.
    """

    def __init__(self, dim: int | None = None):
        self.dim = dim

    def matrix(self, x: torch.Tensor, what: str, *, fix: bool, finite: bool = True) -> torch.Tensor:
        """``x`` as a ``[n, dim]`` float tensor; ``fix`` lets it set the width; ``finite=False``
        leaves the NaN/infinity check to the caller (:func:`require_finite`, or folded into
        work the caller reads back from the device anyway)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim == 1:
            raise ValueError(f"{what} must be 2-D [n, dim], got shape {tuple(x.shape)} (use x[None] for one row)")
        if x.ndim != 2:
            raise ValueError(f"{what} must be 2-D [n, dim], got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{what} must be a floating-point tensor, got {x.dtype}")
        if self.dim is None and fix:
            self.dim = int(x.shape[1])
        if self.dim is not None and x.shape[1] != self.dim:
            raise ValueError(f"{what} have dim {x.shape[1]}, this retriever holds dim {self.dim}")
        if finite:
            require_finite(x, what)
        return x


def require_finite(x: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what} contain NaN or infinity")


def last_wins(fact_ids: list[str], x: torch.Tensor) -> tuple[list[str], torch.Tensor]:
    """Drop earlier duplicates of an id within one batch (re-adding replaces)."""
    last = {fact_id: i for i, fact_id in enumerate(fact_ids)}
    if len(last) == len(fact_ids):
        return fact_ids, x
    keep = sorted(last.values())
    return [fact_ids[i] for i in keep], x[keep]
