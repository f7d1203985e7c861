"""What surprised a new user, fixed where it happens: ``/v1/models`` showed the model's path on
disk, the first engine start from the Python API printed nothing of InferScale's own for minutes,
``inferscale demo`` wrote its user into the home data directory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import tiny_models
from inferscale.cli import build_parser
from inferscale.cli import demo as demo_cli
from inferscale.server.engine.routes import without_paths


def test_the_model_list_names_no_path():
    answer = {"object": "list", "data": [
        {"id": "qwen2-float32", "object": "model", "root": "/srv/models/qwen2-float32", "parent": None},
        {"id": "lora-a", "object": "model", "root": "C:\\\\models\\\\a", "parent": "/srv/models/qwen2-float32"},
        {"id": "named", "object": "model", "root": "named", "parent": None}]}
    cards = without_paths(answer)["data"]
    assert [(c["root"], c["parent"]) for c in cards] == [("qwen2-float32", None), ("lora-a", "lora-a"), ("named", None)]
    assert without_paths({"error": "x"}) == {"error": "x"} and without_paths([1]) == [1]


def test_the_library_says_when_it_starts_the_engine(tmp_path):
    model = tiny_models.tiny_model_dir("qwen2", "float32")
    script = textwrap.dedent(f"""
        from inferscale.api import InferScale

        if __name__ == "__main__":
            mem = InferScale.from_config({{"model": {str(model)!r}, "data_dir": {str(tmp_path)!r}}},
                                         max_model_len=-5)  # refused by vLLM as it starts: fast
            try:
                mem.generation.llm
            except Exception as exc:
                print("engine refused:", type(exc).__name__)
    """)
    (tmp_path / "start.py").write_text(script)
    out = subprocess.run([sys.executable, str(tmp_path / "start.py")], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]),
                                                                                    os.environ.get("PYTHONPATH")]))})
    assert "engine refused" in out.stdout, out.stderr[-3000:]
    assert "inferscale: starting vLLM's engine for" in out.stderr and "first start takes minutes" in out.stderr


def test_the_demo_keeps_its_memory_in_a_temporary_directory(monkeypatch):
    seen = []
    monkeypatch.setattr(demo_cli, "_demo", lambda args: seen.append(Path(args.data_dir)) or 0)
    for name in ("INFERSCALE_DATA_DIR", "INFERSCALE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    args = build_parser().parse_args(["demo"])
    assert demo_cli.cmd_demo(args) == 0
    (scratch,) = seen
    assert "inferscale-demo-" in scratch.name and not scratch.exists()  # removed at the end
    args = build_parser().parse_args(["demo", "--data-dir", "/kept"])
    demo_cli.cmd_demo(args)
    assert seen[-1] == Path("/kept")
