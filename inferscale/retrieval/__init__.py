"""Fact retrieval: embedders (text → unit vectors) and per-user top-k retrievers.

``base.py`` holds the interfaces (:class:`Retriever`, :class:`Embedder`, :class:`Hit`), selected by
name through :func:`inferscale.config.build` (``plugin.py`` registers the built-ins). Retrievers:
``exact.py`` (a matmul and a top-k), ``faiss_index.py``, and the GPU graph indexes ``jasper.py`` and
``cagra.py`` (what they share: ``graph_index.py``), over ``per_user.py`` (one index per user, one
lock), ``user_matrix.py`` and ``ranking.py`` (scores → hits, one deterministic order). Embedders:
``embed_local.py`` (sentence-transformers, offline; ``query_graphs.py`` replays a query as a CUDA
graph) and ``embed_openai.py`` (any ``/v1/embeddings``); ``checks.py`` their shared input checks.
Importing this package loads none of faiss, sentence-transformers, openai, jasper or cuVS.
"""

from inferscale.retrieval.base import Embedder, Hit, Retriever

__all__ = ["Embedder", "Hit", "Retriever"]
