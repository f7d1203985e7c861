"""Each route's body cap: what its largest legitimate body needs, checked before the body is
parsed (parsing costs by structure: megabytes of ``[],`` take seconds of the front's one core)."""

from __future__ import annotations

import json

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from inferscale.server import limits
from inferscale.server.chat.request import MAX_CHAT_CHARS
from inferscale.server.memory.schemas import (MAX_FACT_CHARS, MAX_FACT_CHARS_PER_CALL, MAX_FACTS_PER_CALL,
                                       MAX_MESSAGE_CHARS, MAX_MESSAGE_CHARS_PER_CALL, MAX_MESSAGES,
                                       MAX_QUERY_CHARS, AddMemories)

MIB = 1 << 20


def _app() -> TestClient:
    parsed: list[str] = []

    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        parsed.append(request.url.path)
        return JSONResponse({"bytes": len(body)})

    app = Starlette(routes=[Route("/{path:path}", echo, methods=["POST", "PUT", "DELETE", "GET"])])
    app.add_middleware(limits.BodyLimit)
    client = TestClient(app)
    client.parsed = parsed
    return client


def _structure(nbytes: int) -> bytes:
    """A body that is cheap to send and dear to parse."""
    return b'{"user_id": "u", "x": [' + b"[]," * (nbytes // 3) + b"[]]}"


@pytest.mark.parametrize("method, path, size", [
    ("POST", "/v1/memories/search", 5 * MIB), ("PUT", "/v1/memories/f-1", 5 * MIB),
    ("POST", "/v1/memories", 5 * MIB), ("POST", "/v1/chat/completions", 9 * MIB),
    ("POST", "/v1/memories/search/", 100 << 10), ("POST", "/v1/completions", 33 * MIB)])
def test_a_body_over_its_routes_cap_is_refused_before_the_route_reads_it(method, path, size):
    client = _app()
    answer = client.request(method, path, content=_structure(size), headers={"Content-Type": "application/json"})
    assert answer.status_code == 413 and "this route's limit" in answer.text, answer.text
    assert client.parsed == []


def test_a_body_over_the_cap_sent_without_a_length_is_refused_too():
    client = _app()
    chunks = (b" " * (1 << 16) for _ in range(2))  # 128 KiB without a Content-Length
    answer = client.post("/v1/memories/search", content=chunks, headers={"Content-Type": "application/json"})
    assert answer.status_code == 413 and "64 KiB" in answer.text, answer.text


def _escaped(chars: int) -> str:
    return "中" * chars  # json.dumps writes it as \u4e2d: 6 bytes a character


def test_the_largest_legitimate_bodies_pass_their_caps():
    fact = _escaped(MAX_FACT_CHARS_PER_CALL // MAX_FACTS_PER_CALL)
    facts = [{"text": fact, "source_turn": "t" * 128} for _ in range(MAX_FACTS_PER_CALL)]
    per_message = min(MAX_MESSAGE_CHARS, MAX_MESSAGE_CHARS_PER_CALL // MAX_MESSAGES)
    messages = [{"role": "user", "content": _escaped(per_message), "turn_id": "t" * 128} for _ in range(MAX_MESSAGES)]
    add = json.dumps({"user_id": "u" * 128, "facts": facts, "messages": messages}).encode()
    AddMemories.model_validate_json(add)  # within every field limit
    chat = json.dumps({"model": "m" * 200, "user": "u" * 128, "max_tokens": 16, "temperature": 0,
                       "messages": [{"role": "user", "content": _escaped(MAX_CHAT_CHARS)}]}).encode()
    search = json.dumps({"user_id": "u" * 128, "query": _escaped(MAX_QUERY_CHARS), "k": 1024}).encode()
    client = _app()
    for path, body in (("/v1/memories", add), ("/v1/chat/completions", chat), ("/v1/memories/search", search)):
        answer = client.post(path, content=body, headers={"Content-Type": "application/json"})
        assert answer.status_code == 200 and answer.json()["bytes"] == len(body), (path, len(body))


def test_a_calls_messages_are_bounded_together():
    messages = [{"role": "user", "content": "x" * MAX_MESSAGE_CHARS}] * (MAX_MESSAGE_CHARS_PER_CALL // MAX_MESSAGE_CHARS + 1)
    with pytest.raises(ValueError, match="at most 200,000 per call"):
        AddMemories.model_validate({"user_id": "u", "messages": messages})
