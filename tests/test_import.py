import subprocess
import sys


def test_import_inferscale_does_not_import_vllm_or_backends():
    code = (
        "import sys, inferscale, inferscale.config, inferscale.plugins\n"
        "heavy = [m for m in ('vllm', 'faiss', 'sentence_transformers', 'transformers', 'mem0', 'openai') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_core_modules_import_without_vllm():
    code = (
        "import sys\n"
        "import inferscale.compose.segment, inferscale.inject.planner, inferscale.inject.loader\n"
        "import inferscale.storage.disk, inferscale.retrieval.exact, inferscale.encode.encoder, inferscale.kv_fp8\n"
        "from inferscale.kv_fp8 import fp8_round_trip  # (the accuracy screens use it on encoded facts)\n"
        "assert 'vllm' not in sys.modules, 'the core imported vllm'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_front_and_the_client_speak_http_to_vllm():
    """The server reaches vLLM over HTTP only (its internals move between releases: docs/server.md)."""
    code = (
        "import sys\n"
        "import inferscale.server.app, inferscale.server.engine.launch, inferscale.server.serve, inferscale.client\n"
        "assert 'vllm' not in sys.modules, 'the front imported vllm'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
