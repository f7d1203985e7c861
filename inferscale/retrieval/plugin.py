"""Built-in retrievers and embedders, registered through the same hooks as third-party plugins.

The backend modules import torch but neither faiss, sentence-transformers, openai
nor jasper nor cuVS: those load when a backend is built or first used. Jasper
and CAGRA (cuVS) are registered only where they are importable.
"""

from __future__ import annotations

import importlib.util

from inferscale.hookspecs import hookimpl


def jasper_available() -> bool:
    """Whether the Jasper GPU index can be imported here."""
    return importlib.util.find_spec("jasper") is not None


def cagra_available() -> bool:
    """Whether NVIDIA cuVS (CAGRA) can be imported here."""
    try:
        return importlib.util.find_spec("cuvs.neighbors") is not None
    except (ImportError, ValueError):  # no cuvs package at all, or one without a spec
        return False


@hookimpl
def register_retrievers(register):
    from inferscale.retrieval.exact import ExactRetriever
    from inferscale.retrieval.faiss_index import FaissRetriever

    register(ExactRetriever)
    register(FaissRetriever)
    if jasper_available():
        from inferscale.retrieval.jasper import JasperRetriever

        register(JasperRetriever)
    if cagra_available():
        from inferscale.retrieval.cagra import CagraRetriever

        register(CagraRetriever)


@hookimpl
def register_embedders(register):
    from inferscale.retrieval.embed_local import SentenceTransformerEmbedder
    from inferscale.retrieval.embed_openai import OpenAIEmbedder

    register(SentenceTransformerEmbedder)
    register(OpenAIEmbedder)
