"""Health, metrics, and the rest of vLLM's OpenAI API, passed through to the engine.

``GET /health``: 200 while the front can serve: its engine answers its own ``/health``, or,
behind a router (``--engine-url``), at least one replica is healthy — the body lists each
replica's state (``vllm-router`` answers its own ``/health`` 503 while any one worker is down,
which would take every front out of a load balancer though chats still succeed); else 503.
``GET /metrics``: the front's metrics, then the engine's (vLLM's and the connector's).
``GET /v1/models``: the engine's list with no path in it (vLLM shows the model's directory as ``root``).
The engine routes of :data:`engine_routes.ALLOWED` (``/v1/models``, ``/v1/completions``,
``/v1/embeddings``, ``/tokenize``, ``/detokenize``, ``/version``), matched after the path is
decoded and its dot-segments resolved: passed to the engine, except that a client may not send
``kv_transfer_params`` or a ``cache_salt`` (memory is only ever asked for by the server, for the
request's user). Every other path is a 404 from the front itself.
"""

from __future__ import annotations

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

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
    replicas = await _replicas(state) if state.engine_retry_s else None
    if replicas is not None:
        up = sum(r["healthy"] for r in replicas)
        return JSONResponse({"status": "ok" if up else "unavailable", "replicas_healthy": up, "replicas": replicas},
                            status_code=200 if up else 503)
    try:
        response = await state.client.get("/health", timeout=5.0)
    except httpx.HTTPError:
        raise APIError(503, "the engine is not answering") from None
    if response.status_code != 200:
        raise APIError(503, f"the engine answers /health with {response.status_code}")
    return JSONResponse({"status": "ok"})


async def _replicas(state: ServerState) -> list[dict] | None:
    """Each replica's state as the router has it (``vllm-router``'s ``GET /workers``), without its
    address (``/health`` is open), numbered in the order of the addresses so that a replica keeps
    its number from one answer to the next; None when the engine URL is no such router."""
    try:
        response = await state.client.get("/workers", timeout=5.0)
        workers = response.json()["workers"] if response.status_code == 200 else None
        if workers is None:
            return None
        workers = sorted(workers, key=lambda w: str(w.get("url", "")))
        return [{"replica": i, "healthy": w["is_healthy"] is True} for i, w in enumerate(workers)]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """vLLM's list, with no path in it: vLLM names the directory a model was loaded from as its
    ``root`` (and a LoRA's base as its ``parent``); the front shows the served name instead."""
    state: ServerState = request.app.state.inferscale
    try:
        response = await state.client.get("/v1/models", timeout=10.0)
    except httpx.HTTPError:
        raise APIError(503, "the engine is not answering") from None
    return JSONResponse(without_paths(forward.parsed(response.content)), status_code=response.status_code)


def without_paths(answer: object) -> object:
    """A ``/v1/models`` answer whose cards carry no file system path (``root``, ``parent``)."""
    cards = answer.get("data") if isinstance(answer, dict) else None
    for card in cards if isinstance(cards, list) else []:
        for field in ("root", "parent"):
            if isinstance(card, dict) and _is_path(card.get(field)):
                card[field] = card.get("id")
    return answer


def _is_path(value: object) -> bool:
    return isinstance(value, str) and ("/" in value or "\\" in value)


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
