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
        "import inferscale.compose.segment, inferscale.connector.planner, inferscale.connector.loader\n"
        "import inferscale.storage.disk, inferscale.retrieval.exact, inferscale.encode.encoder\n"
        "assert 'vllm' not in sys.modules, 'the core imported vllm'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
