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
    gpu = bench.faiss_gpus() > 0
    assert [(r["backend"], r["n"]) for r in result["rows"]] == [
        (b, n) for n in (300, 600) for b in ("exact", "faiss-flat") + (("faiss-flat-gpu",) if gpu else ())]
    for row in result["rows"]:
        assert row["recall_at_10"] == row["recall_at_20"] == 1.0  # exact and flat find the true top-k
        assert 0 < row["p50_ms"] <= row["p99_ms"] and 0 < row["batch_p50_ms"] <= row["batch_p99_ms"]
        assert row["build_s"] > 0 and "host_mib" in row


def test_held_out_queries_are_not_indexed(bench, tmp_path):
    rows = np.arange(40 * 4, dtype=np.float32).reshape(40, 4) + 1
    np.save(tmp_path / "v.npy", rows)
    x, q = bench.load_corpus(str(tmp_path / "v.npy"), 30, 10, seed=1)
    assert x.shape == (30, 4) and q.shape == (10, 4)
    assert not {tuple(r) for r in x.numpy().round(6)} & {tuple(r) for r in q.numpy().round(6)}
    with pytest.raises(SystemExit, match="31 facts and 10 held-out queries"):
        bench.load_corpus(str(tmp_path / "v.npy"), 31, 10, seed=1)
    with pytest.raises(SystemExit, match="unknown backend"):
        bench.main(["--corpus", str(tmp_path / "v.npy"), "--sizes", "10", "--backends", "exakt"])
