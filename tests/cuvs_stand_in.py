"""A brute-force ``cuvs`` with the calling contract of cuVS 26.10's ``cuvs.neighbors.cagra``.

It checks what the CAGRA adapter passes (float32 rows and queries, keyword-only parameters,
``k <= itopk_size``, uint32 ``[q, k]`` neighbours and float32 distances written in place,
resources passed along) and answers exactly, so the adapter's id mapping, score conversion
and rebuild-on-change are tested on any machine. ``install(monkeypatch)`` puts it in
``sys.modules``; the real library runs in the GPU tests.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import numpy as np
import torch

METRICS = ("sqeuclidean", "inner_product", "cosine")


class Resources:
    def __init__(self, stream=None):
        self.stream = stream

    def sync(self):
        pass


class IndexParams:
    def __init__(self, *, metric="sqeuclidean", intermediate_graph_degree=128, graph_degree=64,
                 build_algo="ivf_pq", **rest):
        assert metric in METRICS and graph_degree <= intermediate_graph_degree
        self.metric, self.graph_degree, self.build_algo = metric, graph_degree, build_algo


class SearchParams:
    def __init__(self, *, itopk_size=64, search_width=1, **rest):
        assert itopk_size % 32 == 0, "the adapter rounds itopk_size to 32"
        self.itopk_size, self.search_width = itopk_size, search_width


class Index:
    def __init__(self, rows: torch.Tensor, metric: str):
        self.rows, self.metric = rows, metric


def _as_tensor(array) -> torch.Tensor:
    return torch.as_tensor(np.asarray(array))


def build(index_params, dataset, resources=None):
    rows = _as_tensor(dataset)
    assert rows.dtype == torch.float32 and rows.ndim == 2 and isinstance(resources, Resources)
    return Index(rows.clone(), index_params.metric)


def search(search_params, index, queries, k, neighbors=None, distances=None, resources=None, filter=None):
    q = _as_tensor(queries)
    out_ids, out_d = np.asarray(neighbors), np.asarray(distances)
    assert q.dtype == torch.float32 and k <= search_params.itopk_size and isinstance(resources, Resources)
    assert out_ids.dtype == np.uint32 and out_ids.shape == (q.shape[0], k)
    assert out_d.dtype == np.float32 and out_d.shape == (q.shape[0], k)
    if index.metric == "inner_product":
        d, i = (q @ index.rows.T).topk(min(k, index.rows.shape[0]), dim=1)  # larger is nearer
    else:
        d, i = (torch.cdist(q, index.rows) ** 2).topk(min(k, index.rows.shape[0]), dim=1, largest=False)
    out_ids[:] = np.iinfo(np.uint32).max  # unfilled slots: an invalid id
    out_ids[:, : i.shape[1]] = i.numpy().astype(np.uint32)
    out_d[:, : d.shape[1]] = d.numpy()
    return distances, neighbors


def install(monkeypatch) -> types.ModuleType:
    """The stand-in as ``cuvs`` (with ``cuvs.common`` and ``cuvs.neighbors.cagra``); returns the cagra
    module, whose ``builds`` counts the graphs built."""
    cuvs, common, neighbors = (types.ModuleType(n) for n in ("cuvs", "cuvs.common", "cuvs.neighbors"))
    cagra = types.ModuleType("cuvs.neighbors.cagra")
    common.Resources = Resources
    cagra.IndexParams, cagra.SearchParams, cagra.search, cagra.builds = IndexParams, SearchParams, search, 0

    def counted_build(index_params, dataset, resources=None):
        cagra.builds += 1
        return build(index_params, dataset, resources)

    cagra.build = counted_build
    cuvs.common, cuvs.neighbors, neighbors.cagra = common, neighbors, cagra
    for name, module in (("cuvs", cuvs), ("cuvs.common", common), ("cuvs.neighbors", neighbors),
                         ("cuvs.neighbors.cagra", cagra)):
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # found by importlib.util.find_spec
        monkeypatch.setitem(sys.modules, name, module)
    return cagra

