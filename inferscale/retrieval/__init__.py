"""Fact retrieval: embedders (text → unit vectors) and per-user top-k retrievers.

Backends (``exact``, ``faiss``, ``jasper``, ``cagra``; ``minilm``, ``openai``) are selected
by name through :func:`inferscale.config.build`; importing this package loads
none of faiss, sentence-transformers, openai, jasper or cuVS.
"""

from inferscale.retrieval.base import Embedder, Hit, Retriever

__all__ = ["Embedder", "Hit", "Retriever"]
