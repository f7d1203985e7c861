"""benchmarks/retrieval_latency.py over a corpus file, at a tiny size on the CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("retrieval_latency", REPO / "benchmarks" / "retrieval_latency.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_a_corpus_run_reports_recall_latency_build_and_memory(bench, tmp_path):
    rows = np.random.default_rng(0).standard_normal((700, 32)).astype(np.float32)
    np.save(tmp_path / "vectors.npy", rows)
    out = tmp_path / "out.json"
    bench.main(["--corpus", str(tmp_path / "vectors.npy"), "--sizes", "300,600", "--queries", "20", "--batch", "16",
                "--batches", "3", "--k", "20", "--threads", "1", "--backends", "exact,faiss-flat,faiss-flat-gpu",
                "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["dim"] == 32 and result["data"] == "corpus:vectors.npy"
    gpu = sys.modules["retrieval_backends"].faiss_gpus() > 0
    assert [(r["backend"], r["n"]) for r in result["rows"]] == [
        (b, n) for n in (300, 600) for b in ("exact", "faiss-flat") + (("faiss-flat-gpu",) if gpu else ())]
    for row in result["rows"]:
        assert row["recall_at_10"] == row["recall_at_20"] == 1.0  # exact and flat find the true top-k
        assert 0 < row["p50_ms"] <= row["p99_ms"] and 0 < row["batch_p50_ms"] <= row["batch_p99_ms"]
        assert row["build_s"] > 0 and "host_mib" in row


def test_held_out_queries_are_not_indexed(bench, tmp_path):
    rows = np.arange(40 * 4, dtype=np.float32).reshape(40, 4) + 1
    np.save(tmp_path / "v.npy", rows)
    sets = _module("vector_sets")
    x, q = sets.load_corpus(str(tmp_path / "v.npy"), 30, 10, seed=1)
    assert x.shape == (30, 4) and q.shape == (10, 4)
    assert not {tuple(r) for r in x.numpy().round(6)} & {tuple(r) for r in q.numpy().round(6)}
    with pytest.raises(SystemExit, match="31 facts and 10 held-out queries"):
        sets.load_corpus(str(tmp_path / "v.npy"), 31, 10, seed=1)
    with pytest.raises(SystemExit, match="unknown backend"):
        bench.main(["--corpus", str(tmp_path / "v.npy"), "--sizes", "10", "--backends", "exakt"])


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_backend_names_carry_their_parameters(bench):
    backends = sys.modules["retrieval_backends"]
    assert backends.parse("jasper:r=64,beam=512,alpha=1.5") == (
        "jasper", {"n_neighbors": 64, "beam_width": 512, "alpha": 1.5})
    assert backends.parse("jasper-wide") == ("jasper", {"beam_width": 1024})
    assert backends.parse("cagra:itopk=256,algo=ivf_pq") == ("cagra", {"itopk_size": 256, "build_algo": "ivf_pq"})
    assert bench.split_backends("exact,jasper:r=64,beam=512,cagra,faiss-hnsw:ef=512") == [
        "exact", "jasper:r=64,beam=512", "cagra", "faiss-hnsw:ef=512"]
    with pytest.raises(SystemExit, match="'q=1' is not one of"):
        backends.parse("jasper:q=1")
    retriever = backends.factory("faiss-hnsw:m=8,ef=16")()
    assert (retriever.options.hnsw_m, retriever.options.ef_search, retriever.options.approx_min) == (8, 16, 1)


def test_each_size_records_how_hard_its_vectors_are(bench, tmp_path):
    out = tmp_path / "out.json"
    bench.main(["--data", "clustered", "--sizes", "2000", "--queries", "16", "--batch", "16", "--batches", "2",
                "--k", "10", "--dim", "16", "--threads", "1", "--backends", "exact", "--out", str(out)])
    [hard] = json.loads(out.read_text())["difficulty"]
    assert hard["n"] == 2000 and hard["k"] == 10 and hard["queries"] == 16
    assert 1 < hard["lid_p10"] <= hard["lid_median"] <= hard["lid_p90"] < 64
    assert hard["contrast_at_1_median"] >= hard["contrast_at_10_median"] > 1


def test_lid_of_points_on_a_line_is_one_and_of_a_cube_its_dimension():
    difficulty = _module("neighbour_difficulty")
    import torch

    g = torch.Generator().manual_seed(0)
    for dim in (1, 4):  # points (and other points as queries) in the unit cube of `dim` of 8 dimensions
        x = torch.zeros(20200, 8)
        x[:, :dim] = 0.25 + 0.5 * torch.rand(20200, dim, generator=g)  # queries far from the cube's faces
        lid = difficulty.lid_mle(difficulty.knn_distances(x[200:], x[:200], 50)).median()
        assert abs(float(lid) - dim) < 0.25 * dim, (dim, float(lid))


def test_the_table_picks_the_fastest_backend_that_reaches_the_recall_floor(tmp_path):
    table = _module("retrieval_table")
    row = {"n": 1000, "data": "corpus:v.npy", "recall_at_10": 1.0, "p99_ms": 1.0, "batch_p50_ms": 1.0,
           "batch_p99_ms": 1.0, "build_s": 0.1, "gpu_mib": None, "host_mib": 1.0}
    result = {"data": "corpus:v.npy", "k": 50, "command": "c", "difficulty": [
        {"n": 1000, "k": 50, "lid_median": 9.0, "lid_p10": 5.0, "lid_p90": 12.0, "contrast_at_50_median": 1.5}]}
    (tmp_path / "retrieval_corpus.json").write_text(json.dumps({**result, "rows": [
        {**row, "backend": "exact", "recall_at_50": 1.0, "p50_ms": 0.8},
        {**row, "backend": "cagra", "recall_at_50": 0.97, "p50_ms": 0.3}]}))
    (tmp_path / "retrieval_corpus_jasper192.json").write_text(json.dumps({**result, "rows": [
        {**row, "backend": "jasper:beam=512", "recall_at_50": 0.90, "p50_ms": 0.1}]}))
    table.main([str(p) for p in sorted(tmp_path.glob("*.json"))] + ["--out", str(tmp_path / "t")])
    written = json.loads((tmp_path / "t.json").read_text())
    assert written["defaults"] == {"corpus:v.npy": {"1000": "cagra"}}
    md = (tmp_path / "t.md").read_text()
    assert "jasper[L=192]:beam=512" in md and "Default: **cagra**" in md and "LID 9.0" in md
    assert (tmp_path / "t.png").stat().st_size > 10_000


def test_a_backend_that_fails_ends_only_its_own_row(bench, tmp_path, monkeypatch):
    backends = sys.modules["retrieval_backends"]

    def broken(extra):
        raise RuntimeError("libcuvs.so: cannot open shared object file")

    monkeypatch.setitem(backends.BASES, "cagra", (broken, {}))
    monkeypatch.setattr(bench, "available", lambda names: names)
    out = tmp_path / "out.json"
    bench.main(["--data", "clustered", "--sizes", "500", "--queries", "8", "--batch", "8", "--batches", "2",
                "--k", "5", "--dim", "8", "--threads", "1", "--backends", "cagra,exact", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["backend"] for r in result["rows"]] == ["exact"]
    assert result["failures"] == [{"backend": "cagra", "n": 500, "error": "RuntimeError: libcuvs.so: cannot open shared object file"}]
    table = _module("retrieval_table")
    table.main([str(out), "--out", str(tmp_path / "t")])
    assert "- cagra at 500: RuntimeError" in (tmp_path / "t.md").read_text()
