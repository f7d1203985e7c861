"""faiss top-k: one faiss index per user, exact for small users, HNSW or IVF for large ones.

Every user starts on an exact ``IndexFlatIP`` (behind ``IndexIDMap2``, which maps
faiss ids to our int64 keys). With ``kind="hnsw"`` or ``"ivf"`` a user whose
count reaches ``approx_min`` is moved to that approximate index, built from the
flat index's vectors. Keys are never reused, so a replaced fact gets a new key.

Deletion: flat and IVF remove in place; HNSW cannot remove, so a delete (or a
replace) rebuilds that user's HNSW from its stored vectors — O(n) per call.

GPU: when faiss sees a GPU (a faiss-gpu build), flat and IVF users are searched
through a GPU copy of their index (``GpuIndexFlatIP`` / ``GpuIndexIVFFlat``, on
GPU 0 or the ``cuda:N`` of ``device``), made lazily and dropped on every change;
the CPU index stays the source of truth. ``device="cuda"`` on a faiss without GPU
support is an error, not a silent CPU run. HNSW has no faiss GPU version: it stays
on the CPU, and ``kind="hnsw"`` with a ``cuda`` device is refused.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from inferscale.retrieval.base import Hit
from inferscale.retrieval.per_user import PerUserRetriever
from inferscale.retrieval.ranking import sort_hits
from inferscale.retrieval.checks import check_k, check_positive

KINDS = ("flat", "hnsw", "ivf")
_GPU_MAX_K = 2048  # faiss GPU indexes refuse larger k


def import_faiss():
    """The faiss module, or an ImportError that says how to install it."""
    try:
        import faiss
    except ImportError as exc:
        raise ImportError(
            "the 'faiss' retriever needs faiss: pip install faiss-cpu (or a faiss-gpu build for your CUDA)"
        ) from exc
    return faiss


class FaissRetriever(PerUserRetriever):
    """Inner-product search with faiss, per user; scores are faiss's float32 inner products."""

    name: ClassVar[str] = "faiss"

    @dataclass(frozen=True)
    class Options:
        #: Index for users with at least ``approx_min`` facts: "flat" (exact), "hnsw" or "ivf".
        kind: str = "flat"
        approx_min: int = 10_000
        #: HNSW graph degree, build and search beam widths.
        hnsw_m: int = 32
        ef_construction: int = 200
        ef_search: int = 256
        #: IVF lists (``None``: about 4·√n, at most n/39) and lists probed per query.
        nlist: int | None = None
        nprobe: int = 16
        #: ``None``: a GPU when faiss sees one; "cpu", or "cuda" / "cuda:N" to insist (flat and ivf only).
        device: str | None = None
        #: Expected embedding width; ``None``: fixed by the first ``add``.
        dim: int | None = None

        def __post_init__(self):
            if self.kind not in KINDS:
                raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
            gpu_number(self.device)  # checks the spelling
            if self.kind == "hnsw" and self.device is not None and self.device.startswith("cuda"):
                raise ValueError("kind='hnsw' has no faiss GPU index: use kind='flat' or 'ivf' on "
                                 f"device={self.device!r}, or device='cpu'")
            for what in ("approx_min", "hnsw_m", "ef_construction", "ef_search", "nprobe"):
                check_positive(getattr(self, what), what)
            if self.nlist is not None:
                check_positive(self.nlist, "nlist")

    def __init__(self, options: Options | None = None, **runtime: Any):
        """``runtime`` objects are accepted and ignored (faiss picks its own device)."""
        self.options = options or self.Options()
        self._faiss = import_faiss()
        self._gpu = _gpu_resources(self._faiss, self.options.device)
        self._gpu_number = gpu_number(self.options.device) or 0
        super().__init__(self.options.dim)

    @property
    def on_gpu(self) -> bool:
        return self._gpu is not None

    def add(self, user_id: str, fact_ids: Sequence[str], embeddings: torch.Tensor) -> None:
        with self._lock:
            ids, x = self._rows(fact_ids, embeddings)
            if not ids:
                return
            if user_id not in self._users:
                self._users[user_id] = _UserIndex(self._faiss, self._dims.dim, self.options,
                                                  self._gpu, self._gpu_number)
            self._users[user_id].upsert(ids, _numpy(x))

    def search(self, user_id: str, queries: torch.Tensor, k: int) -> list[list[Hit]]:
        with self._lock:
            q = self._dims.matrix(queries, "queries", fix=False)
            check_k(k)
            user = self._users.get(user_id)
            if user is None or len(user) == 0 or k == 0:
                return [[] for _ in range(q.shape[0])]
            return user.search(_numpy(q), k)


    def index_kind(self, user_id: str) -> str | None:
        """Which index a user is on now ("flat", "hnsw", "ivf"), ``None`` if unknown."""
        user = self._users.get(user_id)
        return None if user is None else user.kind


class _UserIndex:
    """One user's faiss index and the ``fact_id`` ↔ int64 key maps."""

    def __init__(self, faiss, dim: int, options: FaissRetriever.Options, gpu, gpu_number: int = 0):
        self.faiss, self.dim, self.opts, self.gpu, self.gpu_number = faiss, dim, options, gpu, gpu_number
        self.kind = "flat"
        self.index = self._new_index("flat", None)
        self.key_of: dict[str, int] = {}
        self.fact_of: dict[int, str] = {}
        self.next_key = 0
        self._mirror: tuple[Any, np.ndarray | None] | None = None

    def __len__(self) -> int:
        return len(self.key_of)

    def upsert(self, fact_ids: list[str], x: np.ndarray) -> None:
        self.remove([f for f in fact_ids if f in self.key_of])
        keys = np.arange(self.next_key, self.next_key + len(fact_ids), dtype=np.int64)
        self.next_key += len(fact_ids)
        for fact_id, key in zip(fact_ids, keys.tolist()):
            self.key_of[fact_id], self.fact_of[key] = key, fact_id
        self.index.add_with_ids(x, keys)
        self._mirror = None
        if self.kind == "flat" and self.opts.kind != "flat" and len(self) >= self.opts.approx_min:
            self._rebuild(np.empty(0, dtype=np.int64))

    def remove(self, fact_ids: list[str]) -> None:
        keys = np.array([self.key_of.pop(f) for f in fact_ids if f in self.key_of], dtype=np.int64)
        if keys.size == 0:
            return
        for key in keys.tolist():
            del self.fact_of[key]
        if self.kind == "hnsw":
            self._rebuild(keys)
        else:
            self.index.remove_ids(keys)
        self._mirror = None

    def search(self, q: np.ndarray, k: int) -> list[list[Hit]]:
        """Top ``k``; fetches more while a tie with the k-th score reaches the last fetched hit."""
        k, fetch = min(k, len(self)), min(k + 1, len(self))
        scores, keys = self._search(q, fetch)
        while fetch < len(self) and _tie_reaches_end(scores, keys, k):
            fetch = min(2 * fetch, len(self))
            scores, keys = self._search(q, fetch)
        return [
            sort_hits(((s, self.fact_of[key]) for s, key in zip(s_row, k_row) if key >= 0), k)
            for s_row, k_row in zip(scores.tolist(), keys.tolist())
        ]

    def _search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        with _omp_threads(self.faiss, q.shape[0]):
            return self._search_now(q, k)

    def _search_now(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if self.kind == "hnsw":
            self.faiss.downcast_index(self.index.index).hnsw.efSearch = max(self.opts.ef_search, k)
        if self.gpu is None or self.kind == "hnsw" or k > _GPU_MAX_K:
            return self.index.search(q, k)
        index, keys = self._gpu_mirror()
        scores, found = index.search(q, k)
        if keys is not None:  # the flat mirror has no id map: positions → keys
            found = np.where(found >= 0, keys[found.clip(min=0)], -1)
        return scores, found

    def _gpu_mirror(self) -> tuple[Any, np.ndarray | None]:
        if self._mirror is None:
            faiss = self.faiss
            if self.kind == "flat":
                keys = faiss.vector_to_array(self.index.id_map).astype(np.int64)
                self._mirror = (faiss.index_cpu_to_gpu(self.gpu, self.gpu_number, self.index.index), keys)
            else:
                self._mirror = (faiss.index_cpu_to_gpu(self.gpu, self.gpu_number, self.index), None)
        return self._mirror

    def _rebuild(self, drop: np.ndarray) -> None:
        """Rebuild from the current (flat or HNSW) index's vectors, without keys ``drop``."""
        vectors = self.index.index.reconstruct_n(0, self.index.ntotal)
        keys = self.faiss.vector_to_array(self.index.id_map).astype(np.int64)
        if drop.size:
            keep = ~np.isin(keys, drop)
            vectors, keys = vectors[keep], keys[keep]
        self.kind = self.opts.kind if len(keys) >= self.opts.approx_min else "flat"
        self.index = self._new_index(self.kind, vectors)
        if len(keys):
            self.index.add_with_ids(np.ascontiguousarray(vectors), keys)
        self._mirror = None

    def _new_index(self, kind: str, train: np.ndarray | None):
        faiss, opts = self.faiss, self.opts
        if kind == "flat":
            return faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))
        if kind == "hnsw":
            hnsw = faiss.IndexHNSWFlat(self.dim, opts.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            hnsw.hnsw.efConstruction = opts.ef_construction
            return faiss.IndexIDMap2(hnsw)
        nlist = _nlist(opts.nlist, len(train))
        ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(self.dim), self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        ivf.train(np.ascontiguousarray(train))
        ivf.nprobe = min(opts.nprobe, nlist)
        return ivf


@contextlib.contextmanager
def _omp_threads(faiss, n_queries: int) -> Iterator[None]:
    """At most one OpenMP thread per query during a search, then faiss's setting again.

    faiss's CPU searches split work by query, so threads beyond ``n_queries``
    only wait at the barrier: on 2 busy cores a 1-query search of 1k vectors
    took 12-16 ms with 2 threads and 0.16 ms with 1. The setting is
    process-wide; it is changed only for the duration of one search.
    """
    before = faiss.omp_get_max_threads()
    if n_queries >= before:
        yield
        return
    faiss.omp_set_num_threads(max(1, n_queries))
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


def _tie_reaches_end(scores: np.ndarray, keys: np.ndarray, k: int) -> bool:
    """Whether some row's last fetched hit ties with its k-th (so more may tie beyond)."""
    return bool(np.any((scores[:, -1] == scores[:, k - 1]) & (keys[:, -1] >= 0)))


def _nlist(requested: int | None, n: int) -> int:
    """IVF list count: as asked (at most n), else about 4·√n with ≥ 39 training points per list."""
    if requested is not None:
        return max(1, min(requested, n))
    return max(1, min(int(4 * math.sqrt(n)), n // 39))


def gpu_number(device: str | None) -> int | None:
    """The GPU a ``device`` option names (``"cuda"`` is GPU 0), ``None`` for ``None``/``"cpu"``."""
    if device in (None, "cpu"):
        return None
    if device == "cuda":
        return 0
    prefix, _, number = str(device).partition(":")
    if prefix != "cuda" or not number.isdigit():
        raise ValueError(f"device must be None, 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return int(number)


def _gpu_resources(faiss, device: str | None):
    """faiss GPU resources when a GPU is wanted and available, else ``None``."""
    gpus = faiss.get_num_gpus() if hasattr(faiss, "StandardGpuResources") else 0
    wanted = gpu_number(device)
    if device is not None and wanted is not None and wanted >= gpus:
        seen = f"sees {gpus} GPU(s)" if gpus else "sees no GPU (faiss-cpu? install a faiss-gpu build for your CUDA)"
        raise RuntimeError(f"faiss retriever: device={device!r} but this faiss build {seen}")
    if device == "cpu" or gpus == 0:
        return None
    return faiss.StandardGpuResources()


def _numpy(x: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy())
