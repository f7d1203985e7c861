"""Talking to the engine (vLLM's OpenAI server on loopback) over HTTP.

The front never imports vLLM's server code: it speaks only the HTTP API that
both supported releases share, so a vLLM upgrade that moves its modules
around leaves this file alone.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from inferscale.server.engine_guard import RESET_PATH
from inferscale.server.errors import APIError

logger = logging.getLogger(__name__)

#: request headers the engine sees (no client credentials: the front adds the engine key itself)
REQUEST_HEADERS = ("content-type", "accept", "x-request-id")
RESPONSE_HEADERS = ("content-type", "x-request-id")


def engine_client(base_url: str, key: str | None = None) -> httpx.AsyncClient:
    """No read timeout (answers stream for as long as they take); a short connect timeout; every
    request carries the engine key (:mod:`inferscale.server.engine_guard`)."""
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None, connect=10.0), headers=headers)


async def post_json(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                    headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """POST a JSON body; (status, parsed JSON answer)."""
    try:
        response = await client.post(path, json=body, headers=headers)
    except httpx.HTTPError as exc:
        raise _unavailable(exc) from None
    return response.status_code, _json(response.content)


async def open_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                      headers: dict[str, str] | None = None) -> httpx.Response:
    """POST and keep the answer open (the caller closes it)."""
    try:
        return await client.send(client.build_request("POST", path, json=body, headers=headers), stream=True)
    except httpx.HTTPError as exc:
        raise _unavailable(exc) from None


async def error_from(response: httpx.Response) -> JSONResponse:
    """The engine's refusal, passed on as it came (vLLM answers in OpenAI's error shape)."""
    content = await response.aread()
    await response.aclose()
    return JSONResponse(_json(content), status_code=response.status_code)


async def sse_events(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent event stream, ``[DONE]`` included."""
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def proxy(request: Request, client: httpx.AsyncClient, body: bytes, path: str) -> Response:
    """Pass a request through to ``path`` on the engine (the allow-listed route the request's
    path normalizes to), streaming the answer back."""
    headers = {k: v for k, v in request.headers.items() if k.lower() in REQUEST_HEADERS}
    return await relay(client, client.build_request(request.method, path, params=request.query_params,
                                                    content=body, headers=headers))


async def relay(client: httpx.AsyncClient, upstream: httpx.Request) -> Response:
    """Send ``upstream`` to the engine and stream its answer back as it comes."""
    try:
        response = await client.send(upstream, stream=True)
    except httpx.HTTPError as exc:
        raise _unavailable(exc) from None
    keep = {k: v for k, v in response.headers.items() if k.lower() in RESPONSE_HEADERS}
    return StreamingResponse(response.aiter_raw(), status_code=response.status_code, headers=keep,
                             background=BackgroundTask(response.aclose))


async def reset_prefix_cache(client: httpx.AsyncClient) -> bool:
    """Empty the engine's prefix cache (the engine lock's own route, :mod:`engine_guard`: running
    requests are preempted and computed again, so it succeeds); True once it did."""
    try:
        response = await client.post(RESET_PATH, timeout=60.0)
    except httpx.HTTPError as exc:
        logger.warning("the engine's prefix cache could not be reset: %s", type(exc).__name__)
        return False
    done = response.status_code == 200 and _json(response.content).get("success") is True
    if not done:
        logger.warning("the engine's prefix cache was not reset (HTTP %d)", response.status_code)
    return done


#: the error type of an answer whose body was not JSON (vLLM answers JSON; a router may not)
NOT_JSON = "engine_error"


def parsed(content: bytes) -> Any:
    """An answer's body as JSON, or an error in OpenAI's shape holding its text."""
    return _json(content)


def replayed_response(response: httpx.Response, content: bytes) -> httpx.Response:
    """A response whose body was read, to be passed on as if it had not been."""
    return httpx.Response(response.status_code, headers=response.headers, content=content,
                          request=response.request)


def _json(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return {"error": {"message": content.decode(errors="replace")[:500], "type": NOT_JSON}}


def _unavailable(exc: Exception) -> APIError:
    logger.warning("the engine did not answer: %s: %s", type(exc).__name__, exc)
    return APIError(503, "the engine is not answering (starting, restarting or gone); try again shortly")
