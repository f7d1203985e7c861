"""The CAGRA retriever (cuVS): its own behaviour, against ``cuvs_stand_in`` here and the real cuVS on a GPU.

The shared retriever suite runs it too (``cagra-stand-in`` in test_retrieval.py).
"""

from __future__ import annotations

import pytest
import torch

import cuvs_stand_in
from inferscale.retrieval.plugin import cagra_available

DIM = 16


HAS_CUVS = cagra_available() and torch.cuda.is_available()
NO_CUVS = "needs a CUDA GPU and NVIDIA cuVS (pip install cuvs-cu13)"


def unit(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(*shape, generator=g), dim=-1)


def ids_of(hits) -> list[str]:
    return [h.fact_id for h in hits]


@pytest.fixture
def cagra(monkeypatch):
    return cuvs_stand_in.install(monkeypatch)


def small(**options):
    from inferscale.retrieval.cagra import CagraRetriever

    return CagraRetriever(CagraRetriever.Options(device="cpu", graph_degree=2, intermediate_graph_degree=4, **options))


def test_the_graph_is_rebuilt_once_per_change_and_small_users_go_exact(cagra):
    r = small(min_graph_size=10)
    x = unit(30, DIM, seed=5)
    r.add("small", [f"s{i}" for i in range(9)], x[:9])
    assert ids_of(r.search("small", x[:1], 1)[0]) == ["s0"]
    assert cagra.builds == 0
    r.add("big", [f"b{i}" for i in range(20)], x[:20])
    r.add("big", [f"b{i}" for i in range(20, 30)], x[20:])
    assert ids_of(r.search("big", x[[25]], 1)[0]) == ["b25"]
    assert ids_of(r.search("big", x[[3]], 1)[0]) == ["b3"]
    assert cagra.builds == 1
    r.delete("big", ["b25"])
    assert ids_of(r.search("big", x[[25]], 29)[0])[0] != "b25" and r.count("big") == 29
    assert cagra.builds == 2


def test_users_below_the_librarys_floor_are_searched_exactly(cagra):
    r = small(min_graph_size=1)  # min_nodes: 2 × intermediate_graph_degree = 8
    x = unit(7, DIM, seed=1)
    r.add("u", [f"f{i}" for i in range(7)], x)
    assert ids_of(r.search("u", x[[4]], 3)[0])[0] == "f4" and cagra.builds == 0


@pytest.mark.parametrize("metric", ["sqeuclidean", "inner_product"])
def test_scores_from_distances_without_rescoring(metric, cagra):
    r = small(min_graph_size=1, rescore=False, metric=metric)
    x = unit(12, DIM, seed=6)
    r.add("u", [f"f{i}" for i in range(12)], x)
    hits = r.search("u", x[:2], 4)
    exact = (x[:2] @ x.T).topk(4, dim=1)
    assert cagra.builds == 1
    for row, values in zip(hits, exact.values):
        assert [h.score for h in row] == pytest.approx(values.tolist(), abs=1e-4)


def test_itopk_covers_the_candidates_in_steps_of_32():
    from inferscale.retrieval.cagra import MAX_ITOPK, itopk_for

    assert itopk_for(128, 100) == 128
    assert itopk_for(64, 100) == 128
    assert itopk_for(100, 10) == 128
    assert itopk_for(512, 600) == MAX_ITOPK


def test_wanting_more_candidates_than_a_search_returns_goes_exact(cagra):
    r = small(min_graph_size=1)
    x = unit(600, DIM, seed=2)
    r.add("u", [f"f{i}" for i in range(600)], x)
    hits = r.search("u", x[:1], 300)  # 600 candidates wanted > 512
    assert len(hits[0]) == 300 and hits[0][0].fact_id == "f0" and cagra.builds == 0


def test_options_are_validated(cagra):
    from inferscale.retrieval.cagra import CagraRetriever

    with pytest.raises(ValueError, match="must not exceed intermediate_graph_degree"):
        CagraRetriever.Options(graph_degree=128, intermediate_graph_degree=64)
    with pytest.raises(ValueError, match="itopk_size"):
        CagraRetriever.Options(itopk_size=1024)
    with pytest.raises(ValueError, match="metric"):
        CagraRetriever.Options(metric="cosine")
    with pytest.raises(ValueError, match="build_algo"):
        CagraRetriever.Options(build_algo="hnsw")


def test_without_cuvs_the_error_says_how_to_install_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cuvs", None)
    from inferscale.retrieval.cagra import CagraRetriever

    with pytest.raises(ImportError, match="pip install cuvs-cu13"):
        CagraRetriever()


def test_the_plugin_registers_cagra_only_where_cuvs_imports(cagra):
    from inferscale.retrieval import plugin

    names: list[str] = []
    plugin.register_retrievers(register=lambda cls: names.append(cls.name))
    assert "cagra" in names


@pytest.mark.skipif(not HAS_CUVS, reason=NO_CUVS)
def test_recall_at_10_vs_exact_on_the_gpu():
    from inferscale.retrieval.cagra import CagraRetriever
    from inferscale.retrieval.exact import ExactRetriever

    x, q = unit(5000, 384, seed=10), unit(100, 384, seed=11)
    ids = [f"f{i}" for i in range(5000)]
    exact = ExactRetriever(ExactRetriever.Options(device="cpu"))
    exact.add("u", ids, x)
    truth = [ids_of(h) for h in exact.search("u", q, 10)]
    r = CagraRetriever(CagraRetriever.Options(min_graph_size=1000, itopk_size=256))
    r.add("u", ids, x)
    found = [ids_of(h) for h in r.search("u", q, 10)]
    assert sum(len(set(f) & set(t)) for f, t in zip(found, truth)) / 1000 >= 0.95


@pytest.mark.skipif(not HAS_CUVS, reason=NO_CUVS)
@pytest.mark.parametrize("metric", ["sqeuclidean", "inner_product"])
def test_scores_without_rescoring_match_exact_inner_products_on_the_gpu(metric):
    from inferscale.retrieval.cagra import CagraRetriever

    x = unit(2000, 64, seed=3)
    r = CagraRetriever(CagraRetriever.Options(min_graph_size=1, rescore=False, metric=metric))
    r.add("u", [f"f{i}" for i in range(2000)], x)
    for row, target in zip(r.search("u", x[:4], 5), x[:4]):
        for hit in row:
            assert hit.score == pytest.approx(float(x[int(hit.fact_id[1:])] @ target), abs=2e-3)
