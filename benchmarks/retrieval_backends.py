"""The retrievers ``retrieval_latency.py`` measures, by name, each with its parameters in the name.

A backend is a base name, optionally followed by ``:key=value,...`` that overrides its options,
so one run can sweep a grid:

    exact                           the default retriever (the GPU where there is one)
    faiss-flat, faiss-hnsw, faiss-ivf, faiss-flat-gpu, faiss-ivf-gpu
    faiss-hnsw:m=32,ef=512          HNSW degree and search beam (ef_construction: efc=)
    faiss-ivf-gpu:nprobe=64         IVF lists probed (lists: nlist=)
    jasper:r=64,beam=512,alpha=1.2  Jasper graph degree, search beam, pruning factor (entry=first|medoid)
    cagra:degree=64,itopk=256       CAGRA graph degree (intermediate: idegree=), results kept, algo=
    jasper-wide                     jasper:beam=1024 (the name of earlier runs)

Approximate indexes are used from the first fact on (``approx_min`` / ``min_graph_size`` 1),
and each row of a result names the backend exactly as given.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from inferscale.retrieval.base import Retriever
from inferscale.retrieval.exact import ExactRetriever
from inferscale.retrieval.faiss_index import FaissRetriever
from inferscale.retrieval.plugin import cagra_available, jasper_available

_FAISS_KEYS = {"m": "hnsw_m", "ef": "ef_search", "efc": "ef_construction", "nlist": "nlist", "nprobe": "nprobe"}
_JASPER_KEYS = {"r": "n_neighbors", "beam": "beam_width", "alpha": "alpha", "distance": "distance",
                "rerank": "rerank_factor", "entry": "entry"}
_CAGRA_KEYS = {"degree": "graph_degree", "idegree": "intermediate_graph_degree", "itopk": "itopk_size",
               "width": "search_width", "algo": "build_algo", "metric": "metric", "rerank": "rerank_factor"}


def _faiss(kind: str, device: str) -> Callable[[dict], Retriever]:
    return lambda extra: FaissRetriever(FaissRetriever.Options(kind=kind, approx_min=1, device=device, **extra))


def _jasper(extra: dict) -> Retriever:
    from inferscale.retrieval.jasper import JasperRetriever

    return JasperRetriever(JasperRetriever.Options(min_graph_size=1, **extra))


def _cagra(extra: dict) -> Retriever:
    from inferscale.retrieval.cagra import CagraRetriever

    return CagraRetriever(CagraRetriever.Options(min_graph_size=1, **extra))


#: base name → (a factory taking its options' overrides, {short key: option field})
BASES: dict[str, tuple[Callable[[dict], Retriever], dict[str, str]]] = {
    "exact": (lambda extra: ExactRetriever(), {}),
    "faiss-flat": (_faiss("flat", "cpu"), _FAISS_KEYS),
    "faiss-hnsw": (_faiss("hnsw", "cpu"), _FAISS_KEYS),
    "faiss-ivf": (_faiss("ivf", "cpu"), _FAISS_KEYS),
    "faiss-flat-gpu": (_faiss("flat", "cuda"), _FAISS_KEYS),
    "faiss-ivf-gpu": (_faiss("ivf", "cuda"), _FAISS_KEYS),
    "jasper": (_jasper, _JASPER_KEYS),
    "cagra": (_cagra, _CAGRA_KEYS),
}
ALIASES = {"jasper-wide": "jasper:beam=1024"}


def parse(name: str) -> tuple[str, dict]:
    """``"jasper:r=64,beam=512"`` → ``("jasper", {"n_neighbors": 64, "beam_width": 512})``; SystemExit if unknown."""
    base, _, rest = ALIASES.get(name, name).partition(":")
    if base not in BASES:
        raise SystemExit(f"unknown backend {name!r} — known: {', '.join([*BASES, *ALIASES])}")
    keys = BASES[base][1]
    extra = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in keys:
            raise SystemExit(f"backend {name!r}: {item!r} is not one of {', '.join(f'{k}=' for k in keys) or 'nothing'}")
        extra[keys[key]] = _number(value)
    return base, extra


def factory(name: str) -> Callable[[], Retriever]:
    """A function that builds the named backend afresh."""
    base, extra = parse(name)
    make = BASES[base][0]
    return lambda: make(extra)


def _number(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def faiss_gpus() -> int:
    if importlib.util.find_spec("faiss") is None:
        return 0
    import faiss

    return faiss.get_num_gpus() if hasattr(faiss, "StandardGpuResources") else 0


def available(names: list[str]) -> list[str]:
    """The named backends that can run here (Jasper, CAGRA: importable and a GPU; faiss GPU: a faiss-gpu build)."""
    gpu = torch.cuda.is_available()
    runs = {"jasper": gpu and jasper_available(), "cagra": gpu and cagra_available()}
    has_faiss_gpu = faiss_gpus() > 0
    keep = []
    for name in names:
        base = parse(name)[0]
        if runs.get(base, True) and (has_faiss_gpu or not base.endswith("-gpu")):
            keep.append(name)
    return keep
