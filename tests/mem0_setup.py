"""What the Mem0 provider's tests share: Mem0 imported offline (telemetry off, its folder in a temp
dir) with provider "inferscale" registered, and configs for a real ``mem0.Memory`` over the
"inferscale" provider or over Mem0's default store, Qdrant local (the reference), both with the
local MiniLM embedder and ``infer=False`` (the LLM section is never called)."""

from __future__ import annotations

from pathlib import Path

import pytest

#: the first line of a script run in a fresh process (as a Mem0 user's program starts)
SCRIPT_HEAD = ("import json, os, sys\nos.environ['MEM0_TELEMETRY'] = os.environ.get('MEM0_TELEMETRY', 'False')\n"
               "import mem0, inferscale.mem0\ninferscale.mem0.register()\n")


@pytest.fixture(scope="module")
def mem0_module(tmp_path_factory):
    """mem0 with telemetry off and its directory in a temp dir (both read at import), provider registered."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEM0_TELEMETRY", "False")
        mp.setenv("MEM0_DIR", str(tmp_path_factory.mktemp("mem0")))
        mem0 = pytest.importorskip("mem0")
        import inferscale.mem0

        inferscale.mem0.register()
        yield mem0


def common_config(data_dir: Path) -> dict:
    from inferscale.mem0.library import default_embedder_path

    return {
        "embedder": {"provider": "huggingface", "config": {
            "model": default_embedder_path(), "embedding_dims": 384, "model_kwargs": {"local_files_only": True}}},
        "llm": {"provider": "openai", "config": {"api_key": "unused", "openai_base_url": "http://127.0.0.1:9/v1",
                                                 "model": "none"}},
        "history_db_path": str(Path(data_dir) / "history.db"),
    }


def inferscale_config(data_dir: Path, retriever="exact", **store) -> dict:
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    return {"vector_store": {"provider": "inferscale", "config": {
        "data_dir": str(data_dir), "embedding_model_dims": 384, "retriever": retriever, **store}},
        **common_config(data_dir)}


def qdrant_config(data_dir: Path) -> dict:
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    return {"vector_store": {"provider": "qdrant", "config": {
        "path": str(Path(data_dir) / "qdrant"), "on_disk": True, "embedding_model_dims": 384}},
        **common_config(data_dir)}
