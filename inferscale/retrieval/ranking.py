"""Turning scores into hits, with one deterministic order.

Hits are ordered by score, best first; equal scores by ``fact_id`` (ascending).
Every backend uses this order, so backends that see the same scores return the
same lists, and ties at the k-th place never depend on a kernel's whims.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from inferscale.retrieval.base import Hit
from inferscale.retrieval.checks import require_finite


def sort_hits(pairs: Iterable[tuple[float, str]], k: int) -> list[Hit]:
    """The best ``k`` of ``(score, fact_id)`` pairs, ties by ``fact_id``."""
    ranked = sorted(pairs, key=lambda p: (-p[0], p[1]))
    return [Hit(fact_id, float(score)) for score, fact_id in ranked[:k]]


def top_hits(scores: torch.Tensor, fact_ids: Sequence[str], k: int, queries: torch.Tensor | None = None
             ) -> list[list[Hit]]:
    """Top ``k`` of each row of ``scores`` (``[q, n]``, column j is ``fact_ids[j]``).

    ``topk`` picks an arbitrary subset when several columns tie with the k-th
    score; those rows are re-ranked over every column that reaches it. Everything
    the host needs comes back in one copy (on a GPU: one synchronisation per
    search), with, when ``queries`` are given, whether they were all finite
    (``ValueError`` if not).
    """
    q, n = scores.shape
    k = min(k, n)
    if k == 0:
        if queries is not None:
            require_finite(queries, "queries")
        return [[] for _ in range(q)]
    values, index = scores.topk(k, dim=1)
    at_least_kth = (scores >= values[:, -1:]).sum(dim=1, keepdim=True)
    parts = [values.double(), index.double(), at_least_kth.double()]  # float64 holds every index exactly
    if queries is not None:
        parts.append(torch.isfinite(queries).all().double().expand(q, 1).to(scores.device))
    packed = torch.cat(parts, dim=1).cpu()
    if queries is not None and not bool(packed[0, -1]):
        raise ValueError("queries contain NaN or infinity")
    values, index, at_least_kth = packed[:, :k], packed[:, k:2 * k].long(), packed[:, 2 * k]
    out = []
    for row in range(q):
        if int(at_least_kth[row]) > k:  # a tie straddles the cut
            cols = (scores[row] >= scores[row, int(index[row, -1])]).nonzero().flatten()
            row_scores, row_cols = scores[row, cols].cpu().tolist(), cols.cpu().tolist()
        else:
            row_scores, row_cols = values[row].tolist(), index[row].tolist()
        out.append(sort_hits(zip(row_scores, (fact_ids[c] for c in row_cols)), k))
    return out
