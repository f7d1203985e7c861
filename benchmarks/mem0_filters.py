"""What Mem0's filters cost in the "inferscale" provider: one user with 10k memories, filters that keep
1 %, 10 % and 100 % of them, for the exact and the HNSW retriever, with Mem0's Qdrant store (local mode,
in memory) on the same data for reference.

Each memory's payload holds ``user_id`` and ``bucket`` (0-99, evenly), so ``{"bucket": 0}`` keeps 1 %,
``{"bucket": {"lt": 10}}`` 10 %, ``{"bucket": {"gte": 0}}`` 100 %; "user only" is the plain per-user
search. Vectors are clustered (100 centres plus noise, 384-d, the width of MiniLM) so that neighbours
mean something; queries are fresh points near the centres. Timed: ``search`` with ``top_k`` = 80
(what ``Memory.search`` asks of its store for its default 20 results) and ``list`` with 80 (what
``Memory.get_all`` asks for 20), the median over the queries, in one process, after a warm-up.
Recall: the share of the exact filtered top-k found. Prints a table and writes
``benchmarks/results/mem0_filters_cpu.json``.

    python benchmarks/mem0_filters.py                          # 10k memories, 30 queries
    python benchmarks/mem0_filters.py --memories 2000 --queries 5   # quick check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MEM0_TELEMETRY", "False")  # read when mem0 is imported

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
FILTERS = {"user only": {}, "1 %": {"bucket": 0}, "10 %": {"bucket": {"lt": 10}}, "100 %": {"bucket": {"gte": 0}}}
#: the noise around a cluster centre, as a share of the centre's length
SPREAD = 0.6
RETRIEVERS = {"exact": "exact", "hnsw": {"name": "faiss", "options": {"kind": "hnsw", "approx_min": 1000}}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memories", type=int, default=10_000, help="memories of the one user")
    p.add_argument("--queries", type=int, default=30, help="timed queries per filter")
    p.add_argument("--top-k", type=int, default=80, help="hits asked of search, rows of list")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--no-qdrant", action="store_true", help="skip Mem0's Qdrant store")
    p.add_argument("--out", default=str(RESULTS / "mem0_filters_cpu.json"))
    return p.parse_args(argv)


def data(memories: int, queries: int, dim: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    centres = torch.nn.functional.normalize(torch.randn(100, dim, generator=gen), dim=1)
    x = centres[torch.randint(0, 100, (memories,), generator=gen)] + SPREAD * torch.randn(memories, dim, generator=gen) / dim ** 0.5
    q = centres[torch.randint(0, 100, (queries,), generator=gen)] + SPREAD * torch.randn(queries, dim, generator=gen) / dim ** 0.5
    ids = [f"00000000-0000-4000-8000-{i:012d}" for i in range(memories)]
    payloads = [{"user_id": "alice", "data": f"memory {i}", "bucket": i % 100} for i in range(memories)]
    return x, q, ids, payloads


def timed(call, queries) -> tuple[float, list]:
    """Median milliseconds of ``call(q)`` over the queries (after one warm-up), and the results."""
    call(queries[0])
    times, results = [], []
    for q in queries:
        start = time.perf_counter()
        results.append(call(q))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), results


def truth(x, q, payloads, where: dict, k: int) -> tuple[int, list[list[str]]]:
    """How many memories the filter keeps, and the exact filtered top-k (cosine), by brute force."""
    import torch

    from inferscale.mem0.filters import compile_filters

    compiled = compile_filters({"user_id": "alice", **where})
    keep = [i for i, p in enumerate(payloads) if compiled.matches(p)]
    scores = torch.nn.functional.normalize(q, dim=1) @ torch.nn.functional.normalize(x[keep], dim=1).T
    top = scores.topk(min(k, len(keep)), dim=1).indices
    return len(keep), [[f"00000000-0000-4000-8000-{keep[j]:012d}" for j in row.tolist()] for row in top]


def measure_store(store, x, q, payloads, k: int) -> dict:
    rows = {}
    queries = q.tolist()
    for name, where in FILTERS.items():
        filters = {"user_id": "alice", **where}
        search_ms, found = timed(lambda v: [str(r.id) for r in store.search("q", v, k, filters)], queries)
        list_ms, _ = timed(lambda _: store.list(filters=filters, top_k=k), queries[:5])
        kept, exact = truth(x, q, payloads, where, k)
        recall = statistics.mean(len(set(f) & set(t)) / len(t) for f, t in zip(found, exact))
        rows[name] = {"kept": kept, "search_ms": search_ms, "list_ms": list_ms, "recall": recall}
    return rows


def inferscale_rows(args, x, q, ids, payloads, root: Path) -> dict:
    from inferscale.mem0.provider import InferScaleVectorStore

    out = {}
    for name, retriever in RETRIEVERS.items():
        store = InferScaleVectorStore(data_dir=str(root / name), embedding_model_dims=args.dim, retriever=retriever)
        start = time.perf_counter()
        store.insert(x.tolist(), payloads, ids)
        insert_s = time.perf_counter() - start
        out[name] = {"insert_s": insert_s, "filters": measure_store(store, x, q, payloads, args.top_k)}
    return out


def qdrant_rows(args, x, q, ids, payloads) -> dict:
    from mem0.vector_stores.qdrant import Qdrant
    from qdrant_client import QdrantClient

    store = Qdrant(collection_name="mem0", embedding_model_dims=args.dim, client=QdrantClient(":memory:"))
    start = time.perf_counter()
    store.insert(x.tolist(), payloads, ids)
    insert_s = time.perf_counter() - start
    rows = measure_store(_QdrantRows(store), x, q, payloads, args.top_k)
    return {"insert_s": insert_s, "filters": rows}


class _QdrantRows:
    """Mem0's Qdrant store with ``list`` returning its rows like the provider's."""

    def __init__(self, store):
        self.store = store

    def search(self, query, vector, k, filters):
        return self.store.search(query, vector, k, filters)

    def list(self, filters, top_k):
        return self.store.list(filters=filters, top_k=top_k)


def table(result: dict) -> str:
    lines = [f"{'store':<22} {'filter':<10} {'kept':>6} {'search ms':>10} {'list ms':>8} {'recall':>7}"]
    for store, entry in result["stores"].items():
        for name, row in entry["filters"].items():
            lines.append(f"{store:<22} {name:<10} {row['kept']:>6} {row['search_ms']:>10.2f} {row['list_ms']:>8.2f} "
                         f"{row['recall']:>7.3f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    x, q, ids, payloads = data(args.memories, args.queries, args.dim)
    with tempfile.TemporaryDirectory() as tmp:
        stores = {f"inferscale ({k})": v for k, v in inferscale_rows(args, x, q, ids, payloads, Path(tmp)).items()}
    if not args.no_qdrant:
        stores["mem0 qdrant (local)"] = qdrant_rows(args, x, q, ids, payloads)
    result = {"command": "python benchmarks/" + Path(__file__).name + " " + " ".join(sys.argv[1:] if argv is None else argv),
              "memories": args.memories, "queries": args.queries, "top_k": args.top_k, "dim": args.dim,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads 1",
              "stores": stores}
    print(table(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
