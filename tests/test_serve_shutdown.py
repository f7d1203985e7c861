"""A clean stop of `inferscale serve` (the real front and engine, tiny Qwen2): SIGTERM to the front
stops the front, then the engine in order (its API server first, which closes its engine core),
and nothing in the log is a traceback."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

import tiny_models
from vllm_server import inferscale_serve

pytestmark = pytest.mark.slow


def test_sigterm_stops_front_and_engine_without_a_traceback(tmp_path):
    model = tiny_models.tiny_model_dir("qwen2", "float32")
    with inferscale_serve(model, tmp_path / "data", "--max-model-len", "2048") as front:
        added = httpx.post(f"{front.url}/v1/memories", json={"user_id": "maya", "facts": ["Maya has a cat."]},
                           timeout=300)
        assert added.status_code == 201, added.text
        chat = httpx.post(f"{front.url}/v1/chat/completions", timeout=120, json={
            "model": model.name, "user": "maya", "max_tokens": 2, "messages": [{"role": "user", "content": "Pets?"}]})
        assert chat.status_code == 200, chat.text  # an engine that served a request (vLLM then reads its outputs)
        engine = _engine_pid(front.proc.pid)
        os.kill(front.proc.pid, signal.SIGTERM)
        assert front.proc.wait(timeout=90) == 0
        log = front.log_text()
    assert not _alive(engine), "the engine outlived the front"
    assert "Traceback" not in log and "EngineDeadError" not in log, log[-4000:]
    assert "stopping the engine" in log


def _engine_pid(front_pid: int) -> int:
    children = open(f"/proc/{front_pid}/task/{front_pid}/children").read().split()
    (engine,) = [int(pid) for pid in children]
    return engine


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
