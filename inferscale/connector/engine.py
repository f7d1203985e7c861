"""Building a vLLM engine with the InferScale connector."""

from __future__ import annotations

from typing import Any

from inferscale.config import Config

CONNECTOR = "InferScaleConnector"
CONNECTOR_MODULE = "inferscale.connector.vllm_adapter"


def kv_transfer_config(config: Config) -> dict[str, Any]:
    """The ``--kv-transfer-config`` for ``vllm serve`` / ``LLM(kv_transfer_config=...)``.

    Worker-side load failures are recomputed where the vLLM release does that right, so a
    corrupt or vanished fact slows a request down instead of failing it; elsewhere the
    request ends with an error (``compat.load_failure_policy``).
    """
    from inferscale.connector import compat

    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": compat.load_failure_policy(),
        "kv_connector_extra_config": {"config": config.to_dict()},
    }


def make_llm(model_dir: str, config: Config, in_process: bool = False, **engine_kwargs: Any):
    """A ``vllm.LLM`` serving ``model_dir`` with memory injection enabled."""
    from inferscale.connector import compat

    compat.check_release()
    compat.set_engine_environment(compat.platform_device_type(), in_process)
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        dtype=config.model.dtype,
        max_model_len=min(config.model.max_model_len, max_positions(model_dir)),
        enable_prefix_caching=True,
        disable_log_stats=False,
        kv_transfer_config=KVTransferConfig(**kv_transfer_config(config)),
    )
    kwargs.update(engine_kwargs)
    return LLM(**kwargs)


def max_positions(model_dir: str) -> int:
    """The model's own context limit (from config.json; 4096 when it does not say)."""
    import json
    from pathlib import Path

    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    return int(config.get("max_position_embeddings") or 4096)
