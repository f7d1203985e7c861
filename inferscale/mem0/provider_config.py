"""The options of Mem0's ``"inferscale"`` vector-store provider, validated by Mem0's config.

Mem0 imports a provider's config class from ``mem0.configs.vector_stores.<provider>``;
:func:`inferscale.mem0.register` makes this module answer to that name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from inferscale.config import BackendSpec

VECTORS_DIR = ("mem0", "vectors")
_COLLECTION = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class InferScaleConfig(BaseModel):
    """``{"provider": "inferscale", "config": {...}}`` in a Mem0 config."""

    model_config = ConfigDict(extra="forbid")

    collection_name: str = Field("mem0", description="Collection (a directory under the data dir)")
    data_dir: str = Field(description="InferScale's data dir; memories live in <data_dir>/mem0/vectors/<collection>")
    embedding_model_dims: int | None = Field(None, description="Vector width; None: the first stored vectors'")
    retriever: str | dict[str, Any] = Field("exact", description="A retriever name or {name, options}: exact, faiss")
    distance: Literal["cosine", "dot"] = Field("cosine", description="cosine (Qdrant's, Mem0's default): vectors "
                                               "normalized; dot: inner products of the vectors as given")

    @field_validator("collection_name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not _COLLECTION.fullmatch(value):
            raise ValueError(f"collection_name must be 1-128 of [A-Za-z0-9_.-], not starting with '.', got {value!r}")
        return value

    @field_validator("retriever")
    @classmethod
    def _backend(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        BackendSpec.parse(value, "vector_store.config.retriever")
        return value

    @field_validator("embedding_model_dims")
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError(f"embedding_model_dims must be positive, got {value}")
        return value


def collection_root(data_dir: str, collection_name: str) -> Path:
    """Where a collection's files live."""
    return Path(data_dir).expanduser().joinpath(*VECTORS_DIR, collection_name)
