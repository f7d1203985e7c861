"""Jasper top-k: a GPU graph index (Vamana-style, beam search on the device) per user.

* Storage. Each user's vectors live in a float32 :class:`UserMatrix` on the GPU;
  that matrix is the source of truth. The graph is derived from it.
* Changes. ``add`` and ``delete`` only change the matrix and mark the user's
  graph stale; the next ``search`` rebuilds the whole graph from an fp16 copy
  of the rows (so a burst of adds costs one rebuild). Jasper gives a freshly
  built graph the ids ``0..n-1`` in row order, so an id is a row number.
* Small users. A graph needs enough nodes (and Jasper's build hangs on tiny
  inputs, see ``GRAPH_MIN_NODES``): users with fewer than ``min_graph_size``
  facts (or a ``k`` too large for a beam) are searched exactly, exactly as
  :class:`ExactRetriever` does.
* Distance. Jasper's ``"ip"`` distance is the *negated* inner product
  (``inner_product_distance`` in Jasper's ``distance.cuh``: smaller is closer);
  its ``"l2"`` distance is the squared L2 distance. On unit vectors both order
  candidates alike (``|q-v|² = 2 - 2<q,v>``), but Vamana graphs are built for
  a metric: measured on an H200 (R=32, recall@10 vs exact, 5,000 random unit
  384-d vectors) ``"l2"`` gave 0.63/0.84/0.96/0.99 at beam 64/128/256/512 and
  ``"ip"`` 0.47/0.66/0.86/0.96. The default is therefore ``"l2"``, right for
  the unit vectors every InferScale embedder returns; use ``"ip"`` for others.
  Recall falls as a graph grows (100k random vectors, beam 512: 0.44 with
  ``"l2"``), so raise ``beam_width`` with the user's size.
* GPU memory. Each built graph logged one 961 MB segment on the H200 whatever
  its size (1k to 100k vectors), and Jasper prints build progress to stdout:
  per-user graphs suit a few large users, hence the high ``min_graph_size``.
  At these sizes exact search on the GPU was faster anyway (100k vectors,
  k=50: 0.29 ms per query vs 3.3 ms; benchmarks/retrieval_latency.py).
* Scores. With ``rescore=True`` (default) the graph is asked for
  ``rerank_factor·k`` candidates, re-scored in float32 against the stored rows:
  scores are exact inner products, comparable with the other backends, in the
  shared order (ties by ``fact_id``). Without it, ``score = -distance`` for
  ``"ip"`` and ``1 - distance/2`` for ``"l2"`` (the inner product of unit vectors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from inferscale.devices import check_device
from inferscale.retrieval.base import Hit
from inferscale.retrieval.per_user import PerUserRetriever
from inferscale.retrieval.ranking import sort_hits, top_hits
from inferscale.retrieval.checks import check_fact_ids, check_k, check_positive, last_wins
from inferscale.retrieval.user_matrix import UserMatrix

DEGREES = (8, 16, 32, 64)  # the graph degrees (R) Jasper is compiled for
MAX_BEAM = 1983  # Jasper refuses beam_width + 64 >= 2048
#: Floor under ``min_graph_size``: on an H200, ``Graph.build`` never returned
#: for 3, 20 or 40 vectors (R=32); 100 and more worked.
GRAPH_MIN_NODES = 128


def import_jasper():
    """The jasper module, or an ImportError that says where it comes from."""
    try:
        import jasper
    except ImportError as exc:
        raise ImportError(
            "the 'jasper' retriever needs the Jasper GPU index (github.com/saltsystemslab/Jasper) "
            "built with -DJASPER_BUILD_FFI=ON and its python/ folder on PYTHONPATH"
        ) from exc
    return jasper


class JasperRetriever(PerUserRetriever):
    """Graph ANN search on the GPU with Jasper; exact search for small users."""

    name: ClassVar[str] = "jasper"

    @dataclass(frozen=True)
    class Options:
        n_neighbors: int = 32  # graph degree R: 8, 16, 32 or 64
        alpha: float = 1.2  # pruning factor (> 1 keeps long edges)
        beam_width: int = 256
        distance: str = "l2"  # "l2" (unit vectors) or "ip"; see the module docstring
        min_graph_size: int = 1024  # users below this are searched exactly
        rerank_factor: int = 2  # candidates per wanted hit, re-scored exactly
        rescore: bool = True
        device: str = "cuda"
        dim: int | None = None

        def __post_init__(self):
            if self.n_neighbors not in DEGREES:
                raise ValueError(f"n_neighbors must be one of {DEGREES}, got {self.n_neighbors!r}")
            if not self.alpha >= 1.0:
                raise ValueError(f"alpha must be >= 1.0, got {self.alpha!r}")
            for what in ("beam_width", "min_graph_size", "rerank_factor"):
                check_positive(getattr(self, what), what)
            if self.beam_width > MAX_BEAM:
                raise ValueError(f"beam_width must be <= {MAX_BEAM}, got {self.beam_width}")
            if self.distance not in ("l2", "ip"):
                raise ValueError(f"distance must be 'l2' or 'ip', got {self.distance!r}")
            check_device(self.device)

    def __init__(self, options: Options | None = None, **runtime: Any):
        """``runtime`` objects are accepted and ignored (the index lives on ``options.device``)."""
        self.options = options or self.Options()
        self._jasper = import_jasper()
        self.device = torch.device(self.options.device)
        super().__init__(self.options.dim)
        self._graphs: dict[str, Any] = {}  # user_id → a graph of the user's current rows

    def add(self, user_id: str, fact_ids: Sequence[str], embeddings: torch.Tensor) -> None:
        with self._lock:
            x = self._dims.matrix(embeddings, "embeddings", fix=True)
            ids, x = last_wins(check_fact_ids(fact_ids, x.shape[0]), x)
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
            if len(user) < max(self.options.min_graph_size, GRAPH_MIN_NODES) or wanted > MAX_BEAM:
                return top_hits(q @ user.vectors.T, user.fact_ids, k)
            return self._graph_search(user_id, user, q, k, wanted)

    def _graph_search(self, user_id: str, user: UserMatrix, q: torch.Tensor, k: int, wanted: int) -> list[list[Hit]]:
        graph = self._graph(user_id, user)
        beam = max(self.options.beam_width, wanted)
        rows, distances = graph.search(q.half().contiguous(), wanted, beam)
        rows = rows.long()
        valid = (rows >= 0) & (rows < len(user))
        rows = rows.clamp(0, len(user) - 1)
        if self.options.rescore:
            scores = torch.einsum("qd,qcd->qc", q, user.vectors[rows])
        else:
            scores = score_from_distance(distances.float(), self.options.distance)
        return [
            sort_hits(_pairs(user.fact_ids, r_row, s_row, ok_row), k)
            for r_row, s_row, ok_row in zip(rows.tolist(), scores.tolist(), valid.tolist())
        ]

    def _graph(self, user_id: str, user: UserMatrix):
        """The user's graph, rebuilt from the current rows when stale."""
        if user_id not in self._graphs:
            self._graphs[user_id] = self._jasper.Graph.build(
                user.vectors.half().contiguous(),
                n_neighbors=self.options.n_neighbors,
                distance=self.options.distance,
                alpha=self.options.alpha,
            )
        return self._graphs[user_id]


def score_from_distance(distance: torch.Tensor, kind: str) -> torch.Tensor:
    """Jasper's distance → inner product: ``ip`` is ``-<q,v>``; ``l2`` is ``|q-v|²`` (unit vectors)."""
    return -distance if kind == "ip" else 1.0 - distance / 2


def _pairs(fact_ids: list[str], rows: list[int], scores: list[float], valid: list[bool]) -> list[tuple[float, str]]:
    """``(score, fact_id)`` of the valid candidates, each row once."""
    seen: dict[int, float] = {}
    for row, score, ok in zip(rows, scores, valid):
        if ok:
            seen.setdefault(row, score)
    return [(score, fact_ids[row]) for row, score in seen.items()]
