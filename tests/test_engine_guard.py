"""The engine port's lock (inferscale/server/engine_guard.py), in-process over a stand-in app: only
the holder of the engine key is answered, but for the read-only probes; vLLM's admin and dev
routes are locked like the rest; the lock's own reset route empties the prefix cache."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from inferscale.secret import engine_key
from inferscale.server.engine_guard import OPEN_PATHS, RESET_PATH, EngineGuard

KEY = engine_key(b"s" * 32)
AUTH = {"Authorization": f"Bearer {KEY}"}


class EngineClient:
    """Stands in for vLLM's engine client (app.state.engine_client): records the reset it is asked for."""

    def __init__(self):
        self.resets = []

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.resets.append(reset_running_requests)
        return True


def _client() -> TestClient:
    async def answer(request):
        return JSONResponse({"path": request.url.path})

    async def socket(ws):
        await ws.accept()
        await ws.send_text("hi")
        await ws.close()

    app = Starlette(routes=[Route("/{path:path}", answer, methods=["GET", "POST"]), WebSocketRoute("/v1/realtime", socket)])
    app.state.engine_client = EngineClient()
    app.add_middleware(EngineGuard, key=KEY)
    return TestClient(app)


@pytest.mark.parametrize("method, path", [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                          ("POST", "/inference/v1/generate"), ("POST", "/invocations"),
                                          ("GET", "/server_info"), ("POST", "/collective_rpc"), ("POST", "/sleep"),
                                          ("POST", "/reset_prefix_cache"), ("POST", RESET_PATH), ("POST", "/health"),
                                          ("POST", "/tokenize"), ("GET", "/openapi.json")])
def test_without_the_key_the_engine_answers_401(method, path):
    client = _client()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        answer = client.request(method, path, headers=headers)
        assert answer.status_code == 401 and "engine key" in answer.text, (path, headers)
    assert client.app.state.engine_client.resets == []


@pytest.mark.parametrize("path", sorted(OPEN_PATHS))
def test_the_read_only_probes_answer_without_the_key(path):
    assert _client().get(path).json() == {"path": path}


def test_with_the_key_every_route_reaches_vllm():
    client = _client()
    for path in ("/v1/completions", "/server_info"):
        assert client.post(path, headers=AUTH).json() == {"path": path}


def test_a_websocket_without_the_key_is_closed():
    with pytest.raises(WebSocketDisconnect), _client().websocket_connect("/v1/realtime") as ws:
        ws.receive_text()
    with _client().websocket_connect("/v1/realtime", headers=AUTH) as ws:
        assert ws.receive_text() == "hi"


def test_the_locks_reset_route_empties_the_prefix_cache_running_requests_included():
    client = _client()
    assert client.post(RESET_PATH, headers=AUTH).json() == {"success": True}
    assert client.app.state.engine_client.resets == [True]


def test_the_key_comes_from_the_secret_the_launcher_names(tmp_path, monkeypatch):
    from inferscale.config import Config
    from inferscale.secret import load_secret
    from inferscale.server.engine.launch import engine_command, locked_environment

    config = Config.from_dict({"data_dir": str(tmp_path)})
    environment = locked_environment(config, {})
    monkeypatch.setenv("INFERSCALE_SECRET_FILE", environment["INFERSCALE_SECRET_FILE"])
    guard = EngineGuard(lambda *a: None)
    assert guard._expected == f"Bearer {engine_key(load_secret(config.secret_path))}".encode()
    cmd = engine_command(tmp_path, "m", config, 1234, None, [], "cpu")
    assert cmd[cmd.index("--middleware") + 1] == "inferscale.server.engine_guard.EngineGuard"
