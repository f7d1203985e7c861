"""Turning scores into hits, with one deterministic order.

Hits are ordered by score, best first; equal scores by ``fact_id`` (ascending).
Every backend uses this order, so backends that see the same scores return the
same lists, and ties at the k-th place never depend on a kernel's whims.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from inferscale.retrieval.base import Hit
from inferscale.retrieval.checks import require_finite


def sort_hits(pairs: Iterable[tuple[float, str]], k: int) -> list[Hit]:
    """The best ``k`` of ``(score, fact_id)`` pairs, ties by ``fact_id``."""
    ranked = sorted(pairs, key=lambda p: (-p[0], p[1]))
    return [Hit(fact_id, float(score)) for score, fact_id in ranked[:k]]


#: a user with at most this many facts has every score read back and ranked on the host: one
#: copy of a few kilobytes in place of a dozen small kernel launches, each of which costs more
#: host time than ranking the row (the query-to-first-token path)
HOST_RANKED_SCORES = 4096


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
    if n <= HOST_RANKED_SCORES:
        return _ranked_on_host(scores, fact_ids, k, queries)
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


def _ranked_on_host(scores: torch.Tensor, fact_ids: Sequence[str], k: int, queries: torch.Tensor | None
                    ) -> list[list[Hit]]:
    """:func:`top_hits` from the whole score rows, read back in one copy with the queries."""
    n = scores.shape[1]
    packed = (scores if queries is None else torch.cat([scores, queries.to(scores.dtype)], dim=1)).cpu().numpy()
    if queries is not None and not np.isfinite(packed[:, n:]).all():
        raise ValueError("queries contain NaN or infinity")
    out = []
    for row in packed[:, :n]:
        kth = np.partition(row, n - k)[n - k]
        cols = np.flatnonzero(row >= kth).tolist()  # every column that ties with the k-th score
        out.append(sort_hits(zip(row[cols].tolist(), (fact_ids[c] for c in cols)), k))
    return out
