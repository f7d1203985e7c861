"""CAGRA top-k: NVIDIA cuVS's GPU graph index (``cuvs.neighbors.cagra``) per user.

How users, changes, small users and scores are handled: :mod:`inferscale.retrieval.graph_index`.
What is CAGRA's own:

* Build. A k-NN graph of ``intermediate_graph_degree`` (by NN-descent, or IVF-PQ) pruned to
  ``graph_degree`` edges a node, from the user's float32 rows, which the index reads in place
  (the graph holds them, and any change drops the graph first).
* Search. ``itopk_size`` results are kept while the search walks (CAGRA's main recall knob; at
  least the candidates wanted, rounded up to 32), ``search_width`` nodes expanded per step.
  Work runs on torch's current CUDA stream, so no synchronisation is added.
* Distance. ``"sqeuclidean"`` (default, right for the unit vectors every InferScale embedder
  returns: ``|q-v|² = 2 - 2<q,v>``) or ``"inner_product"``. Without ``rescore`` the score is
  ``1 - d/2`` or cuVS's inner product.

Install: ``pip install cuvs-cu13`` (or ``cuvs-cu12``) matching the CUDA of torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from inferscale.devices import check_device
from inferscale.retrieval.checks import check_positive
from inferscale.retrieval.graph_index import GraphRetriever

METRICS = ("sqeuclidean", "inner_product")
BUILD_ALGOS = ("nn_descent", "ivf_pq", "iterative_cagra_search")
#: Most candidates one search returns: CAGRA's single-CTA search keeps at most 512 (itopk_size).
MAX_ITOPK = 512


def import_cagra():
    """``cuvs.neighbors.cagra`` and ``cuvs.common.Resources``, or an ImportError that says how to install them."""
    try:
        from cuvs.common import Resources
        from cuvs.neighbors import cagra
    except ImportError as exc:
        raise ImportError(
            "the 'cagra' retriever needs NVIDIA cuVS and a CUDA GPU: pip install cuvs-cu13 (or cuvs-cu12, "
            f"matching torch's CUDA) ({exc})"
        ) from exc
    return cagra, Resources


@dataclass
class _Graph:
    index: Any  # cuvs.neighbors.cagra.Index
    rows: torch.Tensor  # the float32 rows it was built from, kept alive beside it


class CagraRetriever(GraphRetriever):
    """Graph ANN search on the GPU with cuVS CAGRA; exact search for small users."""

    name: ClassVar[str] = "cagra"

    @dataclass(frozen=True)
    class Options:
        graph_degree: int = 64
        intermediate_graph_degree: int = 128
        build_algo: str = "nn_descent"
        itopk_size: int = 128  # raised to the candidates wanted when smaller
        search_width: int = 1
        metric: str = "sqeuclidean"
        min_graph_size: int = 1024  # users below this are searched exactly
        rerank_factor: int = 2  # candidates per wanted hit, re-scored exactly
        rescore: bool = True
        device: str = "cuda"
        dim: int | None = None

        def __post_init__(self):
            for what in ("graph_degree", "intermediate_graph_degree", "itopk_size", "search_width",
                         "min_graph_size", "rerank_factor"):
                check_positive(getattr(self, what), what)
            if self.graph_degree > self.intermediate_graph_degree:
                raise ValueError(f"graph_degree ({self.graph_degree}) must not exceed intermediate_graph_degree "
                                 f"({self.intermediate_graph_degree})")
            if self.itopk_size > MAX_ITOPK:
                raise ValueError(f"itopk_size must be <= {MAX_ITOPK}, got {self.itopk_size}")
            if self.metric not in METRICS:
                raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {self.metric!r}")
            if self.build_algo not in BUILD_ALGOS:
                raise ValueError(f"build_algo must be one of {', '.join(BUILD_ALGOS)}, got {self.build_algo!r}")
            check_device(self.device)

    def __init__(self, options: Options | None = None, **runtime: Any):
        """``runtime`` objects are accepted and ignored (the index lives on ``options.device``)."""
        self._cagra, self._resources_class = import_cagra()
        super().__init__(options or self.Options())
        self._resources: dict[int, Any] = {}  # CUDA stream handle → cuVS resources on that stream

    def build_graph(self, vectors: torch.Tensor) -> _Graph:
        o = self.options
        params = self._cagra.IndexParams(metric=o.metric, graph_degree=o.graph_degree,
                                         intermediate_graph_degree=o.intermediate_graph_degree,
                                         build_algo=o.build_algo)
        rows = vectors.contiguous()
        return _Graph(self._cagra.build(params, rows, resources=self._stream_resources()), rows)

    def graph_candidates(self, graph: _Graph, q: torch.Tensor, wanted: int) -> tuple[torch.Tensor, torch.Tensor]:
        params = self._cagra.SearchParams(itopk_size=itopk_for(self.options.itopk_size, wanted),
                                          search_width=self.options.search_width)
        rows = torch.empty(q.shape[0], wanted, dtype=torch.int32, device=q.device)
        distances = torch.empty(q.shape[0], wanted, dtype=torch.float32, device=q.device)
        self._cagra.search(params, graph.index, q.contiguous(), wanted, neighbors=AsUint32(rows),
                           distances=distances, resources=self._stream_resources())
        if self.options.metric == "sqeuclidean":
            return rows, 1.0 - distances / 2
        return rows, distances

    def max_candidates(self) -> int:
        return MAX_ITOPK

    def min_nodes(self) -> int:
        return 2 * self.options.intermediate_graph_degree

    def _stream_resources(self) -> Any:
        """cuVS resources on torch's current stream of the device, made once per stream."""
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
        if stream not in self._resources:
            self._resources[stream] = self._resources_class(stream=stream or None)
        return self._resources[stream]


def itopk_for(itopk_size: int, wanted: int) -> int:
    """CAGRA keeps at least as many intermediate results as it returns, in steps of 32."""
    return min(MAX_ITOPK, 32 * math.ceil(max(itopk_size, wanted) / 32))


class AsUint32:
    """An int32 tensor seen as uint32, the dtype cuVS writes neighbour ids in (ids < 2³¹ read alike):
    a CUDA array interface on the GPU, a NumPy array interface on the CPU."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.dtype != torch.int32 or not tensor.is_contiguous():
            raise ValueError("AsUint32 wraps a contiguous int32 tensor")
        self.tensor = tensor
        if tensor.is_cuda:
            self.__cuda_array_interface__ = {**tensor.__cuda_array_interface__, "typestr": "<u4"}
        else:
            self.__array_interface__ = {**tensor.numpy().__array_interface__, "typestr": "<u4"}
