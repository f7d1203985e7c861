"""Built-in retrievers and embedders, registered through the same hooks as third-party plugins.

The backend modules import torch but neither faiss, sentence-transformers, openai
nor jasper: those load when a backend is built or first used. Jasper is
registered only where it is importable.
"""

from __future__ import annotations

import importlib.util

from inferscale.hookspecs import hookimpl


def jasper_available() -> bool:
    """Whether the Jasper GPU index can be imported here."""
    return importlib.util.find_spec("jasper") is not None


@hookimpl
def register_retrievers(register):
    from inferscale.retrieval.exact import ExactRetriever
    from inferscale.retrieval.faiss_index import FaissRetriever

    register(ExactRetriever)
    register(FaissRetriever)
    if jasper_available():
        from inferscale.retrieval.jasper import JasperRetriever

        register(JasperRetriever)


@hookimpl
def register_embedders(register):
    from inferscale.retrieval.embed_local import SentenceTransformerEmbedder
    from inferscale.retrieval.embed_openai import OpenAIEmbedder

    register(SentenceTransformerEmbedder)
    register(OpenAIEmbedder)
