"""The class Mem0's ``VectorStoreFactory`` builds for provider ``"inferscale"``.

Mem0 calls it with its config's fields as keywords; it indexes each user's
memories in a retriever built like the server's (``exact``, ``faiss``, ...),
one index per user, and keeps them under the data dir
(:mod:`inferscale.mem0.collection_files`). Importing this module imports Mem0.
"""

from __future__ import annotations

from typing import Any

from mem0.vector_stores.base import VectorStoreBase

from inferscale.config import BackendSpec, build
from inferscale.mem0.provider_config import InferScaleConfig, collection_root
from inferscale.mem0.collection_files import CollectionFiles
from inferscale.mem0.store import RetrieverVectorStore


class InferScaleVectorStore(RetrieverVectorStore, VectorStoreBase):
    """A persistent Mem0 collection over an InferScale retriever."""

    def __init__(self, **config: Any):
        opts = InferScaleConfig(**config)
        retriever = build("retriever", BackendSpec.parse(opts.retriever, "vector_store.config.retriever"))
        files = CollectionFiles(collection_root(opts.data_dir, opts.collection_name))
        super().__init__(retriever, opts.collection_name, opts.embedding_model_dims, files)
        self.config = opts

    def create_col(self, name: str, vector_size: int | None = None, distance: str | None = None):
        """Collections are directories chosen by ``collection_name``; this one cannot be renamed."""
        if name != self.collection_name:
            raise ValueError(f"this store holds collection {self.collection_name!r}: build another store for {name!r}")
        return super().create_col(name, vector_size, distance)
