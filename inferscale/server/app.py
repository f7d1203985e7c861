"""The front's FastAPI application: chat with memory, the memory endpoints, the engine's API.

``create_app(state)`` builds it over a :class:`ServerState`; the HTTP client
to the engine lives as long as the app. With ``state.api_key`` set, every
route but ``/health`` and ``/metrics`` wants ``Authorization: Bearer <key>``.
Request bodies are capped (:mod:`inferscale.server.limits`).
"""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request

from inferscale.server import errors, limits
from inferscale.server.chat.routes import router as chat_router
from inferscale.server.engine import forward
from inferscale.server.engine.routes import router as engine_router
from inferscale.server.memory.routes import router as memory_router
from inferscale.server.state import ServerState

OPEN_PATHS = ("/health", "/metrics")


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.client = forward.engine_client(state.engine_url, state.engine_key)
        try:
            yield
        finally:
            await state.client.aclose()

    app = FastAPI(title="InferScale", summary="vLLM's OpenAI API with per-user memory", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)  # the routes are documented in docs/server.md
    app.state.inferscale = state
    errors.install(app)
    app.add_middleware(limits.BodyLimit)  # inside the guard: its 413s are counted too
    _install_guards(app, state)
    app.include_router(chat_router)
    app.include_router(memory_router)
    app.include_router(engine_router)  # last: it passes every other /v1 path to the engine
    return app


def _install_guards(app: FastAPI, state: ServerState) -> None:
    @app.middleware("http")
    async def guard(request: Request, call_next):
        if state.api_key and request.url.path not in OPEN_PATHS and not _authorized(request, state.api_key):
            response = errors.error_response(401, "missing or wrong API key (Authorization: Bearer <key>)")
        else:
            response = await call_next(request)
        if response.status_code >= 400:
            state.metrics.errors.labels(str(response.status_code)).inc()
        return response


def _authorized(request: Request, key: str) -> bool:
    given = request.headers.get("authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())
