"""The class Mem0's ``VectorStoreFactory`` builds for provider ``"inferscale"``.

Mem0 calls it with its config's fields as keywords; it indexes each user's
memories in a retriever built like the server's (``exact``, ``faiss``, ...),
one index per user, and keeps them under the data dir
(:mod:`inferscale.mem0.collection_files`). Importing this module imports Mem0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mem0.vector_stores.base import VectorStoreBase

from inferscale.config import BackendSpec, build
from inferscale.files import make_dir
from inferscale.mem0.collection_files import CollectionFiles
from inferscale.mem0.provider_config import InferScaleConfig, collection_root
from inferscale.mem0.store import RetrieverVectorStore

#: the collection Mem0 opens for its telemetry (``Memory`` with ``MEM0_TELEMETRY`` on, its default): kept in
#: memory, so that it leaves nothing in the data dir (Mem0 keeps the id it needs in ``~/.mem0`` anyway)
TELEMETRY_COLLECTION = "mem0migrations"


class InferScaleVectorStore(RetrieverVectorStore, VectorStoreBase):
    """A persistent Mem0 collection over an InferScale retriever."""

    def __init__(self, **config: Any):
        opts = InferScaleConfig(**config)
        retriever = build("retriever", BackendSpec.parse(opts.retriever, "vector_store.config.retriever"))
        files = None
        if opts.collection_name != TELEMETRY_COLLECTION:
            make_dir(Path(opts.data_dir).expanduser())  # Mem0's history database may go there (its folder must exist)
            files = CollectionFiles(collection_root(opts.data_dir, opts.collection_name))
        super().__init__(retriever, opts.collection_name, opts.embedding_model_dims, files, opts.distance)
        self.config = opts

    @property
    def embedding_model_dims(self) -> int | None:
        """The vectors' width, under the name Mem0's stores use."""
        return self.dim
