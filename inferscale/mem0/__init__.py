"""Everything InferScale does with Mem0, in one place; the rest of the package reaches it only
through the facade (:mod:`inferscale.api`), by the names this module exports.

* Mem0 as the fact extractor: :mod:`~inferscale.mem0.extract` (``Mem0Extractor``, one
  conversation turn at a time), the endpoint it calls (:mod:`~inferscale.mem0.endpoint`), what
  the LLM is sent and answers (:mod:`~inferscale.mem0.llm_format`), Mem0 itself and its history
  database (:mod:`~inferscale.mem0.library`).
* InferScale as Mem0's vector store, provider ``"inferscale"``: ``register()`` below, the store
  over a retriever (:mod:`~inferscale.mem0.store`, its reads :mod:`~inferscale.mem0.reading`),
  Mem0's filters read on payloads as Qdrant reads them (:mod:`~inferscale.mem0.filters`,
  :mod:`~inferscale.mem0.payload_values`), the users a filter visits
  (:mod:`~inferscale.mem0.scopes`), the class Mem0 builds (:mod:`~inferscale.mem0.provider`),
  its options (:mod:`~inferscale.mem0.provider_config`), its files
  (:mod:`~inferscale.mem0.collection_files`).

::

    import inferscale.mem0
    inferscale.mem0.register()
    memory = mem0.Memory.from_config({
        "vector_store": {"provider": "inferscale", "config": {
            "data_dir": "memory", "embedding_model_dims": 384, "retriever": "exact"}},
        ...})

Mem0 (2.2.1) has no registry for third-party providers: it maps provider names
to classes in ``VectorStoreFactory.provider_to_class`` and to config classes in
``VectorStoreConfig._provider_configs``, importing the config from
``mem0.configs.vector_stores.<provider>``. ``register`` adds ``"inferscale"``
to both maps and that module name; it is idempotent and imports Mem0. Importing
this package imports neither Mem0 nor torch.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from inferscale.mem0.endpoint import ExtractionError

PROVIDER = "inferscale"
STORE_CLASS = "inferscale.mem0.provider.InferScaleVectorStore"
CONFIG_CLASS = "InferScaleConfig"
#: imported on first access (they import torch, or Mem0 on use)
_LAZY = {"Mem0Extractor": "inferscale.mem0.extract", "context_tokens": "inferscale.mem0.endpoint"}

__all__ = ["ExtractionError", "Mem0Extractor", "context_tokens", "forget_user", "register"]


def register() -> None:
    """Make ``"inferscale"`` a Mem0 vector-store provider (see the module docstring)."""
    try:
        import mem0.configs.vector_stores as config_package
        from mem0.utils.factory import VectorStoreFactory
        from mem0.vector_stores.configs import VectorStoreConfig
    except ImportError as exc:
        raise ImportError(f"InferScale's Mem0 vector store needs mem0 ({exc}): pip install mem0ai==2.2.1") from exc
    from inferscale.mem0 import provider_config

    sys.modules[f"{config_package.__name__}.{PROVIDER}"] = provider_config
    setattr(config_package, PROVIDER, provider_config)
    _provider_configs(VectorStoreConfig)[PROVIDER] = CONFIG_CLASS
    VectorStoreFactory.provider_to_class[PROVIDER] = STORE_CLASS


def forget_user(mem0_dir: str | os.PathLike, user_id: str) -> int:
    """Delete everything Mem0 keeps about ``user_id`` under ``mem0_dir`` (``<data_dir>/mem0``): what
    its extraction stored (memories, entity links, history, the session's messages) and the user's
    file in every collection where InferScale is Mem0's vector store (``<mem0_dir>/vectors``).
    Returns how many memories were deleted."""
    from pathlib import Path

    from inferscale.mem0.collection_files import forget_user_files
    from inferscale.mem0.extract import forget_user as forget_extracted

    return forget_extracted(mem0_dir, user_id) + forget_user_files(Path(mem0_dir) / "vectors", user_id)


def _provider_configs(config_class: type) -> dict:
    """Mem0's provider → config-class-name map (a pydantic private attribute's default)."""
    private = getattr(config_class, "__private_attributes__", {}).get("_provider_configs")
    configs = getattr(private, "default", None)
    if not isinstance(configs, dict):
        raise RuntimeError("this Mem0 has no VectorStoreConfig._provider_configs map (InferScale registers "
                           "with mem0ai 2.2.1's): pass the store to an existing Memory with "
                           "inferscale.mem0.store.attach instead")
    return configs


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
