"""Health, metrics, and the rest of vLLM's OpenAI API, passed through to the engine.

``GET /health``: 200 when the engine answers its own ``/health``, else 503.
``GET /metrics``: the front's metrics, then the engine's (vLLM's and the connector's).
The engine routes of :data:`engine_routes.ALLOWED` (``/v1/models``, ``/v1/completions``,
``/v1/embeddings``, ``/tokenize``, ``/detokenize``, ``/version``), matched after the path is
decoded and its dot-segments resolved: passed to the engine, except that a client may not send
``kv_transfer_params`` or a ``cache_salt`` (memory is only ever asked for by the server, for the
request's user). Every other path is a 404 from the front itself.
"""

from __future__ import annotations

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from inferscale.server import forward
from inferscale.server.chat import refuse_reserved
from inferscale.server.engine_routes import allowed_route
from inferscale.server.errors import APIError, json_body
from inferscale.server.state import ServerState

router = APIRouter()
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@router.get("/health")
async def health(request: Request) -> Response:
    state: ServerState = request.app.state.inferscale
    try:
        response = await state.client.get("/health", timeout=5.0)
    except httpx.HTTPError:
        raise APIError(503, "the engine is not answering") from None
    if response.status_code != 200:
        raise APIError(503, f"the engine answers /health with {response.status_code}")
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.inferscale
    text = state.metrics.render().decode()
    try:
        response = await state.client.get("/metrics", timeout=10.0)
        text += response.text if response.status_code == 200 else f"# engine /metrics: HTTP {response.status_code}\n"
    except httpx.HTTPError as exc:
        text += f"# engine /metrics unavailable: {type(exc).__name__}\n"
    return PlainTextResponse(text, media_type=PROMETHEUS_TEXT)


@router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False)
async def passthrough(path: str, request: Request) -> Response:
    state: ServerState = request.app.state.inferscale
    route = allowed_route(_raw_path(request), request.method)
    if route is None:
        raise APIError(404, f"no route {request.method} {request.url.path[:200]}")
    body = await request.body()
    if body:  # whatever the Content-Type says: vLLM reads JSON without one, and in any letter case
        refuse_reserved(json_body(body))
    return await forward.proxy(request, state.client, body, route)


def _raw_path(request: Request) -> str:
    """The path as the client sent it (still percent-encoded), so that it is decoded once, here."""
    raw = request.scope.get("raw_path")
    return raw.decode("latin-1").split("?", 1)[0] if raw else request.scope["path"]
