"""How hard a set of vectors is for an approximate index: local intrinsic dimensionality and contrast.

A graph index (HNSW, Vamana/Jasper, CAGRA) walks from node to node toward the query, and an IVF
index probes the lists nearest it; both work when a query's nearest rows are clearly nearer than
the rest. Two standard measures say how clearly, per query, from exact distances:

* **LID**, the local intrinsic dimensionality: Levina and Bickel's maximum-likelihood estimate from
  the k nearest distances r_1 ≤ … ≤ r_k, ``LID = -1 / mean(ln(r_i / r_k))`` (as used for ANN
  benchmarks by Amsaleg et al., KDD 2015, and Aumüller and Ceccarello, 2019). Sentence-embedding
  sets of the ANN benchmarks sit around 10-25; i.i.d. unit vectors in 384 dimensions far above.
* **Relative contrast at k**: the mean distance from the query to the data over its distance to the
  k-th neighbour (He, Kumar and Chang, ICML 2012, with k = 1). Near 1, the k nearest rows are hardly
  nearer than a random row, and recall@k of any approximate index falls.

    python benchmarks/neighbour_difficulty.py --data uniform --sizes 10000,100000
    python benchmarks/neighbour_difficulty.py --corpus /data/fact-corpus/vectors.npy --sizes 100000

``retrieval_latency.py`` records the same figures beside each size's recall.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

#: rows drawn per query for the mean distance of the relative contrast
CONTRAST_SAMPLE = 2048


def knn_distances(x: torch.Tensor, q: torch.Tensor, k: int, chunk: int = 65536) -> torch.Tensor:
    """Euclidean distances ``[q, k]`` from each query to its k nearest rows of ``x``, nearest first
    (in float64: |q|² + |x|² - 2 q·x loses small distances to rounding in float32)."""
    q = q.double()
    q_sq = (q * q).sum(1, keepdim=True)
    best = torch.full((q.shape[0], 0), float("inf"))
    for start in range(0, x.shape[0], chunk):
        rows = x[start:start + chunk].double()
        d2 = q_sq + (rows * rows).sum(1)[None, :] - 2.0 * q @ rows.T
        best = torch.cat([best, d2], dim=1).topk(min(k, best.shape[1] + d2.shape[1]), dim=1, largest=False).values
    return best.clamp_min(0.0).sqrt().float()


def lid_mle(distances: torch.Tensor) -> torch.Tensor:
    """Per query, the maximum-likelihood LID of its sorted k nearest distances (zeros, i.e. copies, left out)."""
    far = distances[:, -1:].clamp_min(1e-12)
    logs = torch.log(distances.clamp_min(1e-12) / far)
    used = distances > 0
    mean = (logs * used).sum(1) / used.sum(1).clamp_min(1)
    return -1.0 / mean.clamp_max(-1e-12)


def relative_contrast(x: torch.Tensor, q: torch.Tensor, kth: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Per query, the mean distance to a seeded sample of rows over the distance to its k-th neighbour."""
    g = torch.Generator().manual_seed(seed)
    sample = x[torch.randint(0, x.shape[0], (min(CONTRAST_SAMPLE, x.shape[0]),), generator=g)].float()
    mean = torch.cdist(q.float(), sample).mean(1)
    return mean / kth.clamp_min(1e-12)


def difficulty(x: torch.Tensor, q: torch.Tensor, k: int) -> dict:
    """Median (and 10th/90th percentile) LID over the k nearest rows, and median relative contrast at 1 and k."""
    d = knn_distances(x, q, k)
    lid = lid_mle(d)
    rc_k = relative_contrast(x, q, d[:, -1])
    rc_1 = relative_contrast(x, q, d[:, 0])
    pct = torch.tensor([0.1, 0.5, 0.9])
    lid_q = torch.quantile(lid, pct).tolist()
    return {"k": k, "queries": int(q.shape[0]),
            "lid_p10": lid_q[0], "lid_median": lid_q[1], "lid_p90": lid_q[2],
            "contrast_at_1_median": float(rc_1.median()), f"contrast_at_{k}_median": float(rc_k.median())}


def main(argv: list[str] | None = None) -> None:
    from vector_sets import data_name, vectors_for  # the same sets as retrieval_latency.py

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10000,100000")
    p.add_argument("--k", type=int, default=50)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--data", default="uniform", choices=["uniform", "clustered"])
    p.add_argument("--corpus", default=None, help="a float32 .npy of embeddings (replaces --data)")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = p.parse_args(argv)
    args.batch = args.queries
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        x, q = vectors_for(args, n)
        rows.append({"n": n, "data": data_name(args), **difficulty(x, q[: args.queries], args.k)})
        r = rows[-1]
        print(f"{r['data']:>24} n={n:>9,}  LID {r['lid_median']:6.1f} ({r['lid_p10']:.1f}-{r['lid_p90']:.1f})  "
              f"contrast@1 {r['contrast_at_1_median']:.3f}  contrast@{args.k} {r[f'contrast_at_{args.k}_median']:.3f}",
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
