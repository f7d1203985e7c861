"""Ranking each fact's related facts (inferscale.encode.related.nearest)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.encode.related import nearest


def test_nearest_ranks_by_inner_product_most_related_last():
    vectors = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.7, 0.7]])
    ids = ["a", "b", "c", "d"]
    got = nearest(ids, vectors, {"a", "c"}, 2)
    assert got == {"a": ["d", "b"], "c": ["b", "d"]}
    assert nearest(ids, vectors, {"a"}, 10) == {"a": ["c", "d", "b"]}  # never itself, at most the others
    assert nearest(ids, vectors, {"a"}, 0) == {"a": []}
    assert nearest(["a"], vectors[:1], {"a"}, 3) == {"a": []}


def test_nearest_rejects_mismatched_input():
    with pytest.raises(ValueError, match="2 fact ids for 3 vectors"):
        nearest(["a", "b"], torch.zeros(3, 4), {"a"}, 1)
    with pytest.raises(ValueError, match="count"):
        nearest(["a"], torch.zeros(1, 4), {"a"}, -1)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 30), dim=st.integers(1, 16), count=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_nearest_agrees_with_a_brute_force_ranking(n, dim, count, seed):
    gen = torch.Generator().manual_seed(seed)
    vectors = torch.randn(n, dim, generator=gen)
    ids = [f"f{i}" for i in range(n)]
    got = nearest(ids, vectors, set(ids), count)
    for i, fid in enumerate(ids):
        others = sorted((j for j in range(n) if j != i), key=lambda j: float(vectors[i] @ vectors[j]))
        want = others[-min(count, n - 1):]
        scores = [float(vectors[i] @ vectors[int(f[1:])]) for f in got[fid]]
        assert len(got[fid]) == len(want) and fid not in got[fid]
        assert scores == sorted(scores)  # the most related last
        assert scores == pytest.approx([float(vectors[i] @ vectors[j]) for j in want], abs=1e-5)
