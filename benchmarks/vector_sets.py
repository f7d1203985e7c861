"""The vectors the retrieval benchmarks search: uniform unit vectors, a Gaussian mixture, or rows
of a corpus file (``--data``, ``--corpus``), seeded by the set's size so that every benchmark that
asks for the same set gets the same vectors (``retrieval_latency.py``, ``neighbour_difficulty.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def load_corpus(path: str, n: int, queries: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows to index and ``queries`` other rows to ask with, from a seeded shuffle of the corpus."""
    import numpy as np

    rows = np.load(path, mmap_mode="r")
    if rows.ndim != 2 or n + queries > rows.shape[0]:
        raise SystemExit(f"{path}: {rows.shape} rows, but {n:,} facts and {queries} held-out queries are asked for")
    order = np.random.default_rng(seed).permutation(rows.shape[0])
    pick = np.sort(order[:n])  # sorted reads of a memory-mapped file
    x = torch.from_numpy(np.ascontiguousarray(rows[pick], dtype=np.float32))
    q = torch.from_numpy(np.ascontiguousarray(rows[np.sort(order[-queries:])], dtype=np.float32))
    return torch.nn.functional.normalize(x, dim=1), torch.nn.functional.normalize(q, dim=1)


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


def vectors_for(args: argparse.Namespace, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    queries = max(args.queries, args.batch)
    if args.corpus:
        return load_corpus(args.corpus, n, queries, seed=n)
    if args.data == "clustered":
        return clustered(n, args.dim, seed=n, queries=queries)
    return unit(n, args.dim, seed=n), unit(queries, args.dim, seed=n + 1)


def data_name(args: argparse.Namespace) -> str:
    return f"corpus:{Path(args.corpus).name}" if args.corpus else args.data
