"""Related facts: each fact's nearest neighbours under the retrieval embedder.

A request reads the facts retrieved for its question, and facts close to one
question are close to each other. Ranking each fact's neighbours by the same
inner product the retrievers search with picks the facts it will most likely
be read with, for the "neighbours" window policy.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch


def nearest(fact_ids: Sequence[str], vectors: torch.Tensor, chosen: Collection[str], count: int) -> dict[str, list[str]]:
    """For each fact of ``chosen``, the ids of the ``count`` other facts whose vectors score
    highest against its own (inner product), the most related last.

    ``vectors[i]`` is the embedding of ``fact_ids[i]``.
    """
    if len(fact_ids) != len(vectors):
        raise ValueError(f"{len(fact_ids)} fact ids for {len(vectors)} vectors")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rows = [i for i, fid in enumerate(fact_ids) if fid in chosen]
    if not rows or count == 0 or len(fact_ids) < 2:
        return {fact_ids[i]: [] for i in rows}
    matrix = vectors.float().cpu()
    scores = matrix[rows] @ matrix.T
    scores[torch.arange(len(rows)), torch.tensor(rows)] = float("-inf")  # never its own neighbour
    take = min(count, len(fact_ids) - 1)
    best = torch.topk(scores, take, dim=1, sorted=True).indices.tolist()
    return {fact_ids[i]: [fact_ids[j] for j in reversed(order)] for i, order in zip(rows, best)}
