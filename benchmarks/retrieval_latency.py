"""Query latency of the retrievers (exact, faiss flat/HNSW/IVF on the CPU or GPU, Jasper and CAGRA if importable).

One user holds n unit vectors (dim 384, MiniLM's width): random (``--data``) or
the first n rows of a seeded shuffle of an embedded corpus (``--corpus``, e.g.
``benchmarks/fact_corpus.py``'s ``vectors.npy``; queries are held-out rows).
Each backend answers single queries (the serving case: one request, one user)
and batches of ``--batch``. Reports build time, the memory the index took (the
growth of host RSS during the build, noisy below ~10 MiB, and of GPU memory in use), p50/p90/p99 single-query latency,
p50/p99 batch latency and throughput, and recall@10 and @k against exact search. Backends
carry their parameters in their names (``jasper:r=64,beam=512``: ``retrieval_backends.py``), and
each size records how hard its vectors are for any approximate index (LID and relative contrast:
``neighbour_difficulty.py``).

    python benchmarks/retrieval_latency.py                      # n = 1k, 10k, 100k; k = 50
    python benchmarks/retrieval_latency.py --sizes 1000,10000   # quicker
    python benchmarks/retrieval_latency.py --threads 1          # busy or 2-core CPU machines
    python benchmarks/retrieval_latency.py --corpus /data/fact-corpus/vectors.npy --sizes 10000,100000,1000000
    python benchmarks/retrieval_latency.py --backends exact,jasper:beam=256,jasper:r=64,beam=512,cagra:itopk=256

On a loaded 2-core machine torch's and faiss's OpenMP pools with 2 threads ran
10-40x slower than with 1 (threads wait for a core at every barrier): use
``--threads 1`` there, and read ``load_average_1m`` in the JSON.

Writes ``benchmarks/results/retrieval_latency_<device>.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from inferscale.retrieval.base import Retriever
from inferscale.retrieval.exact import ExactRetriever

sys.path.insert(0, str(Path(__file__).resolve().parent))
from neighbour_difficulty import difficulty  # noqa: E402
from retrieval_backends import BASES, available, factory  # noqa: E402
from vector_sets import data_name, vectors_for  # noqa: E402

DEFAULT_BACKENDS = ("exact", "faiss-flat", "faiss-hnsw", "faiss-ivf", "faiss-flat-gpu", "faiss-ivf-gpu", "jasper",
                    "cagra")
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000,10000,100000", help="comma-separated facts per user")
    p.add_argument("--k", type=int, default=50)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--queries", type=int, default=100, help="timed single queries per backend")
    p.add_argument("--batch", type=int, default=64, help="queries per timed batch search")
    p.add_argument("--backends", default=None,
                   help="comma-separated, each a base name with optional :key=value,... (retrieval_backends.py); "
                        f"bases: {', '.join(BASES)}; default: {', '.join(DEFAULT_BACKENDS)}")
    p.add_argument("--data", default="uniform", choices=["uniform", "clustered"],
                   help="uniform: i.i.d. unit vectors (no structure: the hardest case for a graph index); "
                        "clustered: a mixture of n/1000 Gaussian clusters, queries drawn from the same mixture "
                        "(closer to sentence embeddings, which cluster by topic)")
    p.add_argument("--corpus", default=None, help="a float32 .npy of embeddings [rows, dim] (replaces --data)")
    p.add_argument("--batches", type=int, default=10, help="timed batch searches per backend")
    p.add_argument("--threads", type=int, default=None, help="torch and faiss threads (default: leave as is)")
    p.add_argument("--out", default=None, help="JSON path (default: results/retrieval_latency_<device>.json)")
    return p.parse_args(argv)


def device_slug() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def measure(make: Callable[[], Retriever], x: torch.Tensor, q: torch.Tensor, batch: torch.Tensor, k: int,
            batches: int) -> dict:
    """Build, warm up (Jasper builds its graph on the first search), time ``q`` one by one and ``batch``
    ``batches`` times."""
    ids = [f"f{i}" for i in range(x.shape[0])]
    rss, gpu = rss_mib(), gpu_used_mib()
    t0 = time.perf_counter()
    r = make()
    r.add("u", ids, x)
    r.search("u", q[:1], k)
    build_s = time.perf_counter() - t0
    memory = {"host_mib": rss_mib() - rss, "gpu_mib": None if gpu is None else gpu_used_mib() - gpu}
    for row in q[:5]:
        r.search("u", row[None], k)
    single = sorted(timed(lambda: r.search("u", row[None], k)) for row in q)
    hits = r.search("u", batch, k)
    in_batch = sorted(timed(lambda: r.search("u", batch, k)) for _ in range(batches))
    return {
        "build_s": build_s, **memory,
        "p50_ms": percentile(single, 50), "p90_ms": percentile(single, 90), "p99_ms": percentile(single, 99),
        "batch_p50_ms": percentile(in_batch, 50), "batch_p99_ms": percentile(in_batch, 99),
        "batch_qps": len(hits) / (percentile(in_batch, 50) / 1e3),
        "ids": [[h.fact_id for h in row] for row in hits],
    }


def timed(search: Callable[[], object]) -> float:
    """Milliseconds one search took, waiting for the GPU where there is one."""
    t = time.perf_counter()
    search()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def percentile(sorted_ms: list[float], pct: float) -> float:
    """Nearest-rank percentile of a sorted list (p50 of two values is the first)."""
    return sorted_ms[min(len(sorted_ms) - 1, max(0, math.ceil(pct / 100 * len(sorted_ms)) - 1))]


def rss_mib() -> float:
    """This process's resident memory (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def gpu_used_mib() -> float | None:
    """GPU memory in use on the current device (every allocator's, faiss's included), ``None`` without one."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def recall(found: list[list[str]], truth: list[list[str]], k: int) -> float:
    """Share of exact search's top-k that the backend's top-k holds, over all queries."""
    hit = sum(len(set(f[:k]) & set(t[:k])) for f, t in zip(found, truth))
    return hit / max(1, sum(len(t[:k]) for t in truth))


def run(args: argparse.Namespace, save: Callable[[dict], None] = lambda result: None) -> dict:
    """Every backend at every size; ``save`` gets the result so far after each row (a run cut
    short keeps what it measured)."""
    asked = split_backends(args.backends) if args.backends else list(DEFAULT_BACKENDS)
    names = available(asked)  # also refuses unknown names
    if len(names) < len(asked):
        print(f"not available here: {', '.join(n for n in asked if n not in names)}", flush=True)
    rows, sizes, failures = [], [], []
    for n in (int(s) for s in args.sizes.split(",")):
        x, q = vectors_for(args, n)
        truth = exact_ids(x, q[: args.batch], args.k)
        hardness = difficulty(x, q[: args.batch], args.k)
        print(f"n={n:,}: LID {hardness['lid_median']:.1f}, contrast at {args.k} "
              f"{hardness[f'contrast_at_{args.k}_median']:.3f}", flush=True)
        sizes.append({"n": n, **hardness})
        for name in names:
            try:
                m = measure(factory(name), x, q[: args.queries], q[: args.batch], args.k, args.batches)
            except Exception as exc:  # one backend failing (a library that does not load, GPU memory) ends only its row
                failures.append({"backend": name, "n": n, "error": f"{type(exc).__name__}: {exc}"[:500]})
                print(f"{name:>24} {n:>9,}  failed: {failures[-1]['error']}", flush=True)
                continue
            found = m.pop("ids")
            m["recall_at_10"], m[f"recall_at_{args.k}"] = recall(found, truth, 10), recall(found, truth, args.k)
            rows.append({"backend": name, "n": n, "data": data_name(args), **m})
            print_row(rows[-1], args.k)
            save(summary(args, x, sizes, rows, failures))
    return summary(args, x, sizes, rows, failures)


def summary(args: argparse.Namespace, x: torch.Tensor, sizes: list, rows: list, failures: list) -> dict:
    return {
        "device": device_slug(),
        "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0],
        "k": args.k,
        "dim": int(x.shape[1]),
        "data": data_name(args),
        "command": " ".join(["python", "benchmarks/retrieval_latency.py", *(argv_of(args))]),
        "difficulty": sizes,
        "rows": rows,
        "failures": failures,
    }


def split_backends(text: str) -> list[str]:
    """``"exact,jasper:r=64,beam=512,cagra"`` → ``["exact", "jasper:r=64,beam=512", "cagra"]``: a part
    holding ``=`` but no ``:`` continues the backend before it."""
    names: list[str] = []
    for part in filter(None, text.split(",")):
        if "=" in part and ":" not in part and names:
            names[-1] += "," + part
        else:
            names.append(part)
    return names


def exact_ids(x: torch.Tensor, q: torch.Tensor, k: int) -> list[list[str]]:
    """The true top-k of each query (exact search on the CPU, float32)."""
    exact = ExactRetriever(ExactRetriever.Options(device="cpu"))
    exact.add("u", [f"f{i}" for i in range(x.shape[0])], x)
    return [[h.fact_id for h in row] for row in exact.search("u", q, k)]


def argv_of(args: argparse.Namespace) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if v is not None]


def print_row(row: dict, k: int) -> None:
    print(
        f"{row['backend']:>24} {row['n']:>9,} {row['build_s']:>8.2f} {row['host_mib']:>8.0f} "
        f"{row['p50_ms']:>8.3f} {row['p99_ms']:>8.3f} {row['batch_p50_ms']:>9.2f} {row['batch_p99_ms']:>9.2f} "
        f"{row['recall_at_10']:>6.3f} {row[f'recall_at_{k}']:>6.3f}",
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
    print(f"{'backend':>24} {'n':>9} {'build s':>8} {'host MiB':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'b p50 ms':>9} {'b p99 ms':>9} {'R@10':>6} {f'R@{args.k}':>6}")
    out = Path(args.out) if args.out else RESULTS / f"retrieval_latency_{device_slug()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(result: dict) -> None:
        out.write_text(json.dumps(result, indent=2) + "\n")

    write(run(args, save=write))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
