"""InferScale as Mem0's vector store: ``register()``, then provider ``"inferscale"``.

    import inferscale.mem0
    inferscale.mem0.register()
    memory = mem0.Memory.from_config({
        "vector_store": {"provider": "inferscale", "config": {
            "data_dir": "/srv/memory", "embedding_model_dims": 384, "retriever": "exact"}},
        ...})

Mem0 (2.2.1) has no registry for third-party providers: it maps provider names
to classes in ``VectorStoreFactory.provider_to_class`` and to config classes in
``VectorStoreConfig._provider_configs``, importing the config from
``mem0.configs.vector_stores.<provider>``. ``register`` adds ``"inferscale"``
to both maps and that module name; it is idempotent and imports Mem0.
"""

from __future__ import annotations

import sys

PROVIDER = "inferscale"
STORE_CLASS = "inferscale.retrieval.mem0_provider.InferScaleVectorStore"
CONFIG_CLASS = "InferScaleConfig"


def register() -> None:
    """Make ``"inferscale"`` a Mem0 vector-store provider (see the module docstring)."""
    try:
        import mem0.configs.vector_stores as config_package
        from mem0.utils.factory import VectorStoreFactory
        from mem0.vector_stores.configs import VectorStoreConfig
    except ImportError as exc:
        raise ImportError(f"InferScale's Mem0 vector store needs mem0 ({exc}): pip install mem0ai==2.2.1") from exc
    from inferscale.retrieval import mem0_config

    sys.modules[f"{config_package.__name__}.{PROVIDER}"] = mem0_config
    setattr(config_package, PROVIDER, mem0_config)
    _provider_configs(VectorStoreConfig)[PROVIDER] = CONFIG_CLASS
    VectorStoreFactory.provider_to_class[PROVIDER] = STORE_CLASS


def _provider_configs(config_class: type) -> dict:
    """Mem0's provider → config-class-name map (a pydantic private attribute's default)."""
    private = getattr(config_class, "__private_attributes__", {}).get("_provider_configs")
    configs = getattr(private, "default", None)
    if not isinstance(configs, dict):
        raise RuntimeError("this Mem0 has no VectorStoreConfig._provider_configs map (InferScale registers "
                           "with mem0ai 2.2.1's): pass the store to an existing Memory with "
                           "inferscale.retrieval.mem0_store.attach instead")
    return configs
