"""The front's application in-process (FastAPI's TestClient) over real memory on a tiny model.

No engine runs: the memory endpoints need none, and chats answer 503 (a fault,
not a crash). The real server, engine included, is in test_server.py.
"""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

import tiny_models
from inferscale.api import Context
from inferscale.config import Config
from inferscale.server.app import create_app
from inferscale.server.engine.launch import free_port
from inferscale.server.state import ServerState

pytestmark = pytest.mark.slow  # loads a (tiny) model and the embedder
USER = "alice@example.com"
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    model = tiny_models.tiny_model_dir("qwen2", "float32")
    config = Config.from_dict({"model": str(model), "data_dir": str(tmp_path_factory.mktemp("front"))})
    state = ServerState.build(Context(config), f"http://127.0.0.1:{free_port()}", "tiny")  # nothing listens there
    state.warm_up()
    yield state
    state.close()


@pytest.fixture
def client(state):
    state.api_key = None
    with TestClient(create_app(state)) as client:
        yield client


def test_memory_round_trip(client):
    added = client.post("/v1/memories", json={"user_id": USER, "facts": [
        "Alice has a cat named Miso.", {"text": "Alice works as a nurse in Lisbon.", "source_turn": "D1:2"}]})
    assert added.status_code == 201, added.text
    miso, nurse = added.json()["results"]
    assert nurse["source_turn"] == "D1:2" and miso["tokens"] > 0
    listed = client.get("/v1/memories", params={"user_id": USER}).json()["results"]
    assert [f["id"] for f in listed] == [miso["id"], nurse["id"]]
    assert client.get(f"/v1/memories/{miso['id']}", params={"user_id": USER}).json()["result"] == miso
    found = client.post("/v1/memories/search", json={"user_id": USER, "query": "Which pet?", "k": 1}).json()
    assert [f["id"] for f in found["results"]] == [miso["id"]] and "score" in found["results"][0]
    new = client.put(f"/v1/memories/{miso['id']}", json={"user_id": USER, "text": "Alice has a cat named Mochi."})
    assert new.status_code == 200 and new.json()["replaced"] == miso["id"]
    assert client.delete(f"/v1/memories/{nurse['id']}", params={"user_id": USER}).status_code == 200
    texts = [f["text"] for f in client.get("/v1/memories", params={"user_id": USER}).json()["results"]]
    assert texts == ["Alice has a cat named Mochi."]
    assert USER in client.get("/v1/users").json()["users"]
    gone = client.delete("/v1/memories", params={"user_id": USER})
    assert gone.json() == {"user_id": USER, "facts_deleted": 1, "mem0_memories_deleted": 0, "prefix_cache_reset": None}
    assert USER not in client.get("/v1/users").json()["users"]
    assert client.get("/v1/memories", params={"user_id": USER}).status_code == 404


def test_ids_with_slashes_stay_ids(client, state):
    odd = "team/ops%2F@example.com"
    assert client.post("/v1/memories", json={"user_id": odd, "facts": ["Ops owns the pager."]}).status_code == 201
    assert client.get("/v1/memories", params={"user_id": odd}).json()["user_id"] == odd
    assert [p.name for p in (state.memory.config.kv_path / "users").glob("team*")] == ["team%2Fops%252F@example.com"]
    client.delete("/v1/memories", params={"user_id": odd})


@pytest.mark.parametrize("method, path, kwargs, status, needle", [
    ("post", "/v1/memories", {"content": b'{"user_id": "bob", "facts": [', "headers": JSON}, 400, "not valid JSON"),
    ("post", "/v1/memories", {"content": b'{"user_id": "bob"}'}, 400, "give 'facts'"),  # JSON, whatever the type
    ("post", "/v1/memories", {"content": b'[1]'}, 400, "must be a JSON object"),
    ("post", "/v1/memories", {"content": b'{"user_id": "a", "user_id": "b", "facts": ["x"]}'}, 400, "twice"),
    ("post", "/v1/memories", {"json": {"user_id": "u" * 129, "facts": ["x"]}}, 400, "at most 128"),
    ("post", "/v1/memories", {"json": {"user_id": "bob", "facts": ["x" * 2000] * 51}}, 400, "100,000"),
    ("post", "/v1/chat/completions", {"json": {"user": "bob", "vllm_xargs": {"kv_transfer_params": [1]},
                                               "messages": [{"role": "user", "content": "hi"}]}}, 400, "vllm_xargs"),
    ("post", "/v1/chat/completions", {"json": {"user": "bob", "inferscale": {"mode": ["kv"]},
                                               "messages": [{"role": "user", "content": "hi"}]}}, 400, "mode"),
    ("get", "/v1/../load", {}, 404, "no route"),
    ("post", "/v1/memories", {"json": {"user_id": "bob"}}, 400, "give 'facts'"),
    ("post", "/v1/memories", {"json": {"user_id": "bob\n", "facts": ["x"]}}, 400, "control characters"),
    ("post", "/v1/memories", {"json": {"user_id": "_system", "facts": ["x"]}}, 400, "reserved"),
    ("post", "/v1/memories", {"json": {"user_id": "bob", "facts": ["x"], "infer": True}}, 400, "infer"),
    ("post", "/v1/memories", {"json": {"user_id": "bob", "facts": ["x" * 5000]}}, 400, "2000"),
    ("post", "/v1/memories", {"json": {"user_id": "bob", "facts": ["x"] * 1000}}, 400, "256"),
    ("post", "/v1/memories/search", {"json": {"user_id": "bob", "query": "x", "k": 10**9}}, 400, "1024"),
    ("post", "/v1/memories/search", {"json": {"user_id": "nobody", "query": "x"}}, 404, "nobody"),
    ("post", "/v1/memories/search", {"json": {"user_id": "bob", "query": "x", "k": "3"}}, 400,
     "k must be an integer in 1..1024, got '3'"),  # as chat refuses it
    ("post", "/v1/memories/search", {"json": {"user_id": "bob", "query": "x", "k": True}}, 400,
     "k must be an integer in 1..1024, got True"),
    ("get", "/v1/memories/search", {"params": {"user_id": "bob"}}, 405, "searching takes POST"),
    ("delete", "/v1/memories/search", {"params": {"user_id": "bob"}}, 405, "searching takes POST"),
    ("post", "/v1/chat/completions", {"json": {"user": "bob", "messages": [{"role": "user", "content": "hi"}]}},
     400, "'model' is required"),
    ("post", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "hi"}]}}, 400,
     "'model' is required"),  # without a user too, as OpenAI refuses it
    ("get", "/v1/memories", {"params": {"user_id": "nobody"}}, 404, "no memory stored for user 'nobody'"),
    ("get", "/v1/memories", {}, 400, "user_id"),
    ("delete", "/v1/memories/f-0", {"params": {"user_id": "nobody"}}, 404, "nobody"),
    ("put", "/v1/memories/f-0", {"json": {"user_id": "nobody", "text": "x"}}, 404, "nobody"),
    ("post", "/v1/chat/completions", {"content": b"{"}, 400, "not valid JSON"),
    ("post", "/v1/chat/completions", {"content": b"[1, 2]"}, 400, "JSON object"),
    ("post", "/v1/chat/completions", {"json": {"model": "tiny", "user": "nobody",
                                               "messages": [{"role": "user", "content": "hi"}]}}, 404, "nobody"),
    ("post", "/v1/chat/completions", {"json": {"user": "bob", "inferscale": {"k": 10**9},
                                               "messages": [{"role": "user", "content": "hi"}]}}, 400, "1..1024"),
    ("post", "/v1/chat/completions", {"json": {"user": "bob", "inferscale": {"mode": "magic"},
                                               "messages": [{"role": "user", "content": "hi"}]}}, 400, "mode"),
    ("post", "/v1/chat/completions", {"json": {"user": "bob", "messages": []}}, 400, "messages"),
    ("post", "/v1/chat/completions", {"json": {"user": "bob", "messages": [{"role": "tool", "content": "4"}]}},
     400, "role"),
    ("post", "/v1/chat/completions", {"json": {"user": "bob", "logprobs": True,
                                               "messages": [{"role": "user", "content": "hi"}]}}, 400, "logprobs"),
    ("post", "/v1/completions", {"json": {"prompt": [1], "kv_transfer_params": {"inferscale": {}}}}, 400,
     "set by the server"),
    ("post", "/v1/chat/completions", {"json": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                               "cache_salt": "inferscale-0"}}, 400, "set by the server"),
    ("get", "/admin", {}, 404, "no route"),
    # found by hostile inputs against the live server (were 500s or reached the engine)
    ("post", "/v1/memories", {"json": {"user_id": "..", "facts": ["x"]}}, 400, "not a usable name"),
    ("get", "/v1/memories", {"params": {"user_id": "."}}, 400, "not a usable name"),
    ("delete", "/v1/memories", {"params": {"user_id": ".."}}, 400, "not a usable name"),
    ("post", "/v1/chat/completions", {"json": {"user": "..", "messages": [{"role": "user", "content": "hi"}]}},
     400, "not a usable name"),
    ("post", "/v1/chat/completions", {"content": b'{"user": "bob", "temperature": NaN, "messages": '
                                                 b'[{"role": "user", "content": "hi"}]}'}, 400, "NaN is not"),
    ("post", "/v1/chat/completions", {"content": b"[" * 100_000 + b"]" * 100_000}, 400, "nested too deeply"),
    ("post", "/v1/memories", {"content": b'{"user_id": "bob", "facts": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                              "headers": JSON}, 400, "nested too deeply"),
    ("post", "/v1/chat/completions", {"content": b'{"user": "bob", "messages": [{"role": "user", '
                                                 b'"content": "\\ud800"}]}'}, 400, "lone UTF-16 surrogate"),
    ("post", "/v1/memories", {"content": b'{"user_id": "bob", "facts": ["\\udc00"]}', "headers": JSON}, 400,
     "lone UTF-16 surrogate"),
    ("post", "/v1/completions", {"content": json.dumps({"prompt": [1], "cache_salt": "inferscale-0"}).encode()},
     400, "set by the server"),  # no Content-Type: vLLM parses JSON all the same
    ("post", "/v1/completions", {"content": json.dumps({"prompt": [1], "kv_transfer_params": {}}).encode(),
                                 "headers": {"Content-Type": "Application/JSON"}}, 400, "set by the server"),
    ("post", "/v1/chat/completions", {"content": b" " * (33 << 20), "headers": JSON}, 413, "larger than 8 MiB"),
    ("post", "/v1/memories", {"content": (b" " * (1 << 20) for _ in range(40)), "headers": JSON}, 413,
     "larger than 4 MiB"),  # sent in chunks, without a Content-Length
])
def test_bad_input_is_a_clear_4xx(client, method, path, kwargs, status, needle):
    response = getattr(client, method)(path, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["code"] == status


def test_a_wrong_method_on_search_is_a_405_that_names_the_allowed_one(client):
    response = client.get("/v1/memories/search", params={"user_id": "bob", "query": "x"})
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("method, path, allow", [
    ("patch", "/v1/memories", "GET, POST, DELETE"), ("put", "/v1/memories", "GET, POST, DELETE"),
    ("patch", "/v1/memories/f1", "GET, PUT, DELETE"), ("post", "/v1/memories/f1", "GET, PUT, DELETE")])
def test_a_method_a_memory_route_does_not_take_is_a_405(client, method, path, allow):
    response = getattr(client, method)(path, params={"user_id": "bob"}, json={})
    assert response.status_code == 405 and response.headers["allow"] == allow
    assert response.json()["error"]["code"] == 405
    searched = client.post("/v1/memories/search", json={"user_id": "nobody", "query": "x", "k": 1})
    assert searched.status_code == 404 and "no memory stored" in searched.text  # the search route, not a 405


def test_a_missing_engine_is_a_503_not_a_crash(client):
    client.post("/v1/memories", json={"user_id": "bob", "facts": ["Bob lives in Oslo."]})
    chat = {"model": "tiny", "user": "bob", "messages": [{"role": "user", "content": "Where do I live?"}]}
    for body in (chat, {**chat, "stream": True}, {k: v for k, v in chat.items() if k != "user"}):
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 503 and "engine is not answering" in response.json()["error"]["message"]
    assert client.get("/health").status_code == 503
    metrics = client.get("/metrics").text
    retrievals = float(re.search(r"^inferscale_retrieval_seconds_count (\S+)$", metrics, re.M).group(1))
    assert retrievals >= 2 and "# engine /metrics unavailable" in metrics


def test_an_api_key_guards_everything_but_health_and_metrics(client, state):
    state.api_key = "s3cret"
    assert client.get("/v1/users").status_code == 401
    assert client.get("/v1/users", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/users", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/metrics").status_code == 200


class FailingLoadEngine:
    """An engine that ends every request carrying memory K/V with ``finish_reason="error"``, as
    vLLM does with ``kv_load_failure_policy="fail"`` when a segment turns out corrupt on load (a
    fault the CPU build's "recompute" policy never shows), and answers text prompts."""

    def __init__(self):
        import http.server
        import threading

        self.bodies: list[dict] = []
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.bodies.append(body)
                failed = bool(body.get("kv_transfer_params"))
                choice = {"index": 0, "text": "" if failed else "Miso", "finish_reason": "error" if failed else "length"}
                answer = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny", "choices": [choice]}
                if body.get("stream"):
                    payload = f"data: {json.dumps(answer)}\n\ndata: [DONE]\n\n".encode()
                    content_type = "text/event-stream"
                else:
                    payload, content_type = json.dumps(answer).encode(), "application/json"
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def test_a_memory_the_engine_could_not_load_is_answered_from_the_facts_as_text(state):
    client_of = state.engine_url
    engine = FailingLoadEngine()
    state.api_key, state.engine_url = None, engine.url
    try:
        with TestClient(create_app(state)) as client:
            client.post("/v1/memories", json={"user_id": "carol", "facts": ["Carol's cat is called Miso."]})
            chat = {"model": "tiny", "user": "carol", "messages": [{"role": "user", "content": "My cat's name?"}]}
            answer = client.post("/v1/chat/completions", json=chat).json()
            assert answer["choices"][0]["message"]["content"] == "Miso"
            assert answer["inferscale"]["mode"] == "text" and answer["inferscale"]["retried"] == "load_error"
            asked = client.post("/v1/chat/completions", json={**chat, "inferscale": {"mode": "text"}}).json()
            assert asked["inferscale"]["mode"] == "text" and "retried" not in asked["inferscale"]
            with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as response:
                lines = [line for line in response.iter_lines() if line.startswith("data:")]
            first = json.loads(lines[0][5:])
            assert first["choices"][0]["delta"].get("content") == "Miso" and first["inferscale"]["retried"] == "load_error"
    finally:
        state.engine_url = client_of
        engine.close()
    kinds = ["kv" if body.get("kv_transfer_params") else "text" for body in engine.bodies]
    assert kinds == ["kv", "text", "text", "kv", "text"], "each kv chat: the injected request once, then the facts as text; the text chat: once"
    kv, text = engine.bodies[0]["prompt"], engine.bodies[1]["prompt"]
    assert text == kv, "the text request prefills the very tokens the injected one carried"
