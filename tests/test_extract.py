"""Fact extraction with Mem0's pipeline (inferscale.mem0.extract).

The slow tests use a real ``vllm.entrypoints.openai.api_server`` serving the
real Qwen2.5-Coder-0.5B-Instruct on 127.0.0.1 (the engine of the session's ``inferscale serve``,
conftest.py) and run Mem0's real
``Memory.add(infer=True)`` against it — no mocks. The fast tests cover the
error paths and the pure helpers.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferscale.datasets.demo import TURNS
from vllm_server import free_port
from inferscale.encode.window import Turn
from inferscale.errors import ConfigError, InferScaleError
from inferscale.mem0.extract import (
    CappedLLM,
    EndpointUnreachableError,
    Mem0Extractor,
    ServedModel,
    check_context,
    memory_schema,
    pick_model,
    turn_message,
)



def _say(config: pytest.Config, message: str) -> None:
    """Print past pytest's output capture (timings are part of what this test reports)."""
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\n[test_extract] {message}", flush=True)


# ---------------------------------------------------------------- fast tests


def test_unreachable_endpoint_fails_fast_and_names_the_url(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    extractor = Mem0Extractor(Mem0Extractor.Options(llm_base_url=url, store_dir=str(tmp_path / "mem0")))
    with pytest.raises(EndpointUnreachableError) as info:
        extractor.extract("maya", TURNS[:2], progress=False)
    assert isinstance(info.value, InferScaleError)
    assert url in str(info.value)
    assert extractor._memory is None  # failed before loading Mem0 or the embedder


def test_options_are_validated(tmp_path):
    with pytest.raises(ConfigError, match="llm_base_url"):
        Mem0Extractor.Options(llm_base_url="localhost:8000", store_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="store_dir"):
        Mem0Extractor.Options(llm_base_url="http://x/v1", store_dir="")
    with pytest.raises(ConfigError, match="max_facts_per_turn"):
        Mem0Extractor.Options(llm_base_url="http://x/v1", store_dir=str(tmp_path), max_facts_per_turn=0)
    assert Mem0Extractor.Options(llm_base_url="http://x/v1", store_dir="s").output_tokens == 64 + 192 * 5


class _ModelsHandler(http.server.BaseHTTPRequestHandler):
    """A real HTTP endpoint answering GET /v1/models like vLLM with max-model-len 8192."""

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "tiny", "max_model_len": 8192}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _models_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ModelsHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def test_too_short_context_is_a_clear_config_error(tmp_path):
    with _models_server() as url:
        extractor = Mem0Extractor(Mem0Extractor.Options(llm_base_url=url, store_dir=str(tmp_path)))
        with pytest.raises(ConfigError, match="--max-model-len"):
            extractor.extract("maya", TURNS[:1], progress=False)
        wrong = Mem0Extractor(Mem0Extractor.Options(llm_base_url=url, store_dir=str(tmp_path), llm_model="other"))
        with pytest.raises(ConfigError, match="serves: tiny"):
            wrong.check_endpoint()


def test_helpers():
    assert turn_message(Turn("D1:1", "Maya", "Hi"), "Maya") == {"role": "user", "content": "Maya: Hi"}
    bob = turn_message(Turn("D1:2", "Bob", "Yo"), "Maya", name_speakers=False)
    assert bob == {"role": "assistant", "content": "Yo"}
    assert memory_schema(3)["json_schema"]["schema"]["properties"]["memory"]["maxItems"] == 3
    assert pick_model([{"id": "a"}, {"id": "b", "max_model_len": 9}], "b", "u") == ServedModel("b", 9)
    check_context(ServedModel("m", None), 10**6, "u")  # unknown length: not checked
    check_context(ServedModel("m", 12288), 1024, "u")


def test_capped_llm_swaps_only_json_object():
    calls = []

    class Recorder:
        config = "kept"

        def generate_response(self, messages, response_format=None, **kwargs):
            calls.append(response_format)
            return "{}"

    llm = CappedLLM(Recorder(), 2)
    llm.generate_response([], response_format={"type": "json_object"})
    llm.generate_response([], response_format=None)
    assert calls == [memory_schema(2), None]
    assert llm.config == "kept"


# ---------------------------------------------------------------- the real thing


@pytest.fixture(scope="module")
def llm_server(qwen05_front, pytestconfig) -> dict:
    """A real vLLM OpenAI-compatible server for Qwen2.5-Coder-0.5B-Instruct; its /v1 base URL and
    the key its port answers: the engine of the session's `inferscale serve` (conftest.py), vLLM's
    own server with prefix caching and a context that fits Mem0's prompt (check_context fails the
    extraction otherwise)."""
    url = f"http://127.0.0.1:{qwen05_front.engine_port()}/v1"
    _say(pytestconfig, f"vLLM server at {url}")
    return {"llm_base_url": url, "api_key": qwen05_front.engine_headers()["Authorization"].removeprefix("Bearer ")}


def _extract(server: dict, store: Path, turns: list[Turn], **options) -> tuple[list[tuple[str, str]], float]:
    start = time.perf_counter()
    with Mem0Extractor(Mem0Extractor.Options(**server, store_dir=str(store), **options)) as extractor:
        facts = extractor.extract("maya", turns)
    return facts, time.perf_counter() - start


def _check_facts(facts: list[tuple[str, str]], turns: list[Turn], cap: int) -> None:
    assert facts, "Mem0 extracted no fact"
    ids = {t.turn_id for t in turns}
    for text, source in facts:
        assert isinstance(text, str) and text.strip()
        assert source in ids
    assert max(Counter(source for _, source in facts).values()) <= cap


@pytest.mark.slow
def test_mem0_extracts_facts_per_turn(llm_server, tmp_path, pytestconfig):
    turns = TURNS[:2]
    facts, seconds = _extract(llm_server, tmp_path / "mem0", turns)
    _say(pytestconfig, f"{len(turns)} turns, max 5 facts/turn: {len(facts)} facts in {seconds:.0f} s: {facts}")
    _check_facts(facts, turns, 5)


@pytest.mark.slow
def test_mem0_cap_of_one_fact_per_turn(llm_server, tmp_path, pytestconfig):
    turns = TURNS[2:4]
    facts, seconds = _extract(llm_server, tmp_path / "mem0", turns, max_facts_per_turn=1)
    _say(pytestconfig, f"{len(turns)} turns, max 1 fact/turn: {len(facts)} facts in {seconds:.0f} s: {facts}")
    _check_facts(facts, turns, 1)


def test_add_conversation_needs_facts_or_an_llm(tmp_path):
    from inferscale.api import InferScale

    mem = InferScale.from_config({"data_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="facts or llm_base_url"):
        mem.add_conversation("maya", TURNS)


def test_forgetting_a_user_removes_mem0s_memories_history_and_messages(tmp_path):
    """Mem0's own store after forget_user: nothing of the user's left, other users untouched."""
    import sqlite3

    from inferscale.mem0.extract import forget_user, session_scope

    store = tmp_path / "mem0"
    options = Mem0Extractor.Options(llm_base_url="http://127.0.0.1:9/v1", store_dir=str(store))
    with Mem0Extractor(options) as extractor:
        memory = extractor._open(ServedModel("unused", None))
        for user, text in (("maya@example.com", "I have a grey cat called Pixel."), ("bob", "I live in Oslo.")):
            message = {"role": "user", "content": text}
            memory.add([message], user_id=user, infer=False)
            memory.db.save_messages([message], session_scope(user))  # what add(infer=True) keeps of a session
        maya_ids = [str(r.id) for r in memory.vector_store.list(filters={"user_id": "maya@example.com"})[0]]
    assert maya_ids

    assert forget_user(store, "maya@example.com") == len(maya_ids)

    db = sqlite3.connect(store / "history.db")
    history = {row[0] for row in db.execute("SELECT memory_id FROM history")}
    scopes = {row[0] for row in db.execute("SELECT session_scope FROM messages")}
    db.close()
    assert not history & set(maya_ids) and history  # bob's history stays
    assert session_scope("maya@example.com") not in scopes and session_scope("bob") in scopes
    with Mem0Extractor(options) as extractor:
        memory = extractor._open(ServedModel("unused", None))
        assert memory.vector_store.list(filters={"user_id": "maya@example.com"})[0] == []
        assert len(memory.vector_store.list(filters={"user_id": "bob"})[0]) == 1
    assert forget_user(store, "maya@example.com") == 0 and forget_user(tmp_path / "none", "bob") == 0
