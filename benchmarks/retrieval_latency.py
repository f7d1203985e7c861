"""Query latency of the retrievers (exact, faiss flat/HNSW/IVF, Jasper if importable).

One user holds n random unit vectors (dim 384, MiniLM's width); each backend
answers single queries (the serving case: one request, one user) and a batch.
Reports build time, p50/p90 single-query latency, batch throughput and
recall@k against the exact backend.

    python benchmarks/retrieval_latency.py                      # n = 1k, 10k, 100k; k = 50
    python benchmarks/retrieval_latency.py --sizes 1000,10000   # quicker
    python benchmarks/retrieval_latency.py --threads 1          # busy or 2-core CPU machines

On a loaded 2-core machine torch's and faiss's OpenMP pools with 2 threads ran
10-40x slower than with 1 (threads wait for a core at every barrier): use
``--threads 1`` there, and read ``load_average_1m`` in the JSON.

Writes ``benchmarks/results/retrieval_latency_<device>.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from inferscale.retrieval.base import Retriever
from inferscale.retrieval.exact import ExactRetriever
from inferscale.retrieval.faiss_index import FaissRetriever

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000,10000,100000", help="comma-separated facts per user")
    p.add_argument("--k", type=int, default=50)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--queries", type=int, default=100, help="timed single queries per backend")
    p.add_argument("--batch", type=int, default=64, help="queries per timed batch search")
    p.add_argument("--backends", default=None, help="comma-separated subset of: " + ", ".join(BACKENDS))
    p.add_argument("--data", default="uniform", choices=["uniform", "clustered"],
                   help="uniform: i.i.d. unit vectors (no structure: the hardest case for a graph index); "
                        "clustered: a mixture of n/1000 Gaussian clusters, queries drawn from the same mixture "
                        "(closer to sentence embeddings, which cluster by topic)")
    p.add_argument("--threads", type=int, default=None, help="torch and faiss threads (default: leave as is)")
    p.add_argument("--out", default=None, help="JSON path (default: results/retrieval_latency_<device>.json)")
    return p.parse_args(argv)


def _jasper(beam_width: int) -> Callable[[], Retriever]:
    def make() -> Retriever:
        from inferscale.retrieval.jasper import JasperRetriever

        return JasperRetriever(JasperRetriever.Options(min_graph_size=1, beam_width=beam_width))

    return make


#: name → factory; approximate kinds are used from the first fact on (approx_min=1).
BACKENDS: dict[str, Callable[[], Retriever]] = {
    "exact": lambda: ExactRetriever(),
    "faiss-flat": lambda: FaissRetriever(),
    "faiss-hnsw": lambda: FaissRetriever(FaissRetriever.Options(kind="hnsw", approx_min=1)),
    "faiss-ivf": lambda: FaissRetriever(FaissRetriever.Options(kind="ivf", approx_min=1)),
    "jasper": _jasper(256),
    "jasper-wide": _jasper(1024),
}


def available(names: list[str]) -> list[str]:
    has_jasper = importlib.util.find_spec("jasper") is not None and torch.cuda.is_available()
    return [n for n in names if not n.startswith("jasper") or has_jasper]


def device_slug() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def unit(n: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, dim, generator=g), dim=1)


def clustered(n: int, dim: int, seed: int, queries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points and ``queries`` queries from one mixture of ``max(16, n // 1000)`` Gaussian clusters
    (noise half the centres' norm), all normalised."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(max(16, n // 1000), dim, generator=g)

    def draw(m: int) -> torch.Tensor:
        which = torch.randint(0, centres.shape[0], (m,), generator=g)
        return torch.nn.functional.normalize(centres[which] + 0.5 * torch.randn(m, dim, generator=g), dim=1)

    return draw(n), draw(queries)


def measure(make: Callable[[], Retriever], x: torch.Tensor, q: torch.Tensor, batch: torch.Tensor, k: int) -> dict:
    """Build, warm up (Jasper builds its graph on the first search), time ``q`` one by one and ``batch`` at once."""
    ids = [f"f{i}" for i in range(x.shape[0])]
    t0 = time.perf_counter()
    r = make()
    r.add("u", ids, x)
    r.search("u", q[:1], k)
    build_s = time.perf_counter() - t0
    for row in q[:5]:
        r.search("u", row[None], k)
    lat = []
    for row in q:
        t = time.perf_counter()
        r.search("u", row[None], k)
        lat.append((time.perf_counter() - t) * 1e3)
    t = time.perf_counter()
    hits = r.search("u", batch, k)
    batch_s = time.perf_counter() - t
    lat.sort()
    return {
        "build_s": build_s,
        "p50_ms": statistics.median(lat),
        "p90_ms": lat[int(0.9 * (len(lat) - 1))],
        "batch_qps": len(hits) / batch_s,
        "ids": [[h.fact_id for h in row] for row in hits],
    }


def run(args: argparse.Namespace) -> dict:
    names = available(args.backends.split(",") if args.backends else list(BACKENDS))
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        if args.data == "clustered":
            x, q = clustered(n, args.dim, seed=n, queries=max(args.queries, args.batch))
        else:
            x, q = unit(n, args.dim, seed=n), unit(max(args.queries, args.batch), args.dim, seed=n + 1)
        truth = None
        for name in names:
            m = measure(BACKENDS[name], x, q[: args.queries], q[: args.batch], args.k)
            truth = truth or m["ids"]  # recall against the first backend (exact, when selected)
            found = sum(len(set(a) & set(b)) for a, b in zip(m.pop("ids"), truth))
            m["recall_vs_first"] = found / sum(len(t) for t in truth)
            rows.append({"backend": name, "n": n, "data": args.data, **m})
            print_row(rows[-1])
    return {
        "device": device_slug(),
        "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0],
        "k": args.k,
        "dim": args.dim,
        "data": args.data,
        "command": " ".join(["python", "benchmarks/retrieval_latency.py", *(argv_of(args))]),
        "rows": rows,
    }


def argv_of(args: argparse.Namespace) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if v is not None]


def print_row(row: dict) -> None:
    print(
        f"{row['backend']:>11} {row['n']:>8,} {row['build_s']:>8.2f} {row['p50_ms']:>8.3f} "
        f"{row['p90_ms']:>8.3f} {row['batch_qps']:>10,.0f} {row['recall_vs_first']:>7.3f}",
        flush=True,
    )


def set_threads(n: int | None) -> None:
    """Pin torch's and faiss's thread pools (both process-wide) for the whole run."""
    if n is None:
        return
    torch.set_num_threads(n)
    if importlib.util.find_spec("faiss") is not None:
        import faiss

        faiss.omp_set_num_threads(n)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(args.threads)
    print(f"k={args.k} dim={args.dim} device={device_slug()} torch threads={torch.get_num_threads()}")
    print(f"{'backend':>11} {'n':>8} {'build s':>8} {'p50 ms':>8} {'p90 ms':>8} {'batch q/s':>10} {'recall':>7}")
    result = run(args)
    out = Path(args.out) if args.out else RESULTS / f"retrieval_latency_{result['device']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
