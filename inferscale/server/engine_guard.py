"""The engine port's lock: vLLM's API server answers only those who hold the engine key.

Loaded into vLLM's own OpenAI server by ``--middleware`` (an ASGI middleware by import path, the
same in every supported release), by ``inferscale serve`` for its engine and by ``inferscale
engine`` for a replica. Why: vLLM's prefix cache keeps the blocks of a deleted fact or a
forgotten user until it reuses them, and a request carrying a salt the server once issued, with
the same tokens, reads them back — vLLM hashes the salt as given, before the connector is asked,
so no salt scheme can make it stop matching a string it has seen. The port is on loopback (a
replica's, on the private network), which any local process (any host there) can reach; so the
port answers only requests that carry ``Authorization: Bearer <engine key>``, an HMAC of the
server secret (:func:`inferscale.secret.engine_key`) that the front sends with every request
and no one without the secret has, and the front only ever sends salts of a user's current
epoch. A leaked salt is then of no use to anyone: nothing of a deleted memory is readable.

Open without the key: what reads no memory and changes nothing — ``/health`` and ``/ping`` (the
front's and the router's probes), ``/metrics`` (counts), ``/v1/models``, ``/version``, ``/load``.
Everything else, vLLM's admin and dev routes included, is a 401 without the key. With it, one
route of InferScale's own: ``POST /inferscale/reset_prefix_cache`` empties vLLM's prefix cache
(``inferscale serve --forget-resets-prefix-cache``), without vLLM's dev mode, whose routes
(``/server_info``, ``/collective_rpc``, ``/sleep``) stay off.
"""

from __future__ import annotations

import hmac
import logging
import os

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

#: the server secret's path, as the engine's launcher sets it (the key is derived from it)
SECRET_ENV = "INFERSCALE_SECRET_FILE"
#: what answers without the key: reads no memory, changes nothing
OPEN_PATHS = frozenset(("/health", "/ping", "/metrics", "/v1/models", "/version", "/load"))
RESET_PATH = "/inferscale/reset_prefix_cache"
MIDDLEWARE = f"{__name__}.EngineGuard"
logger = logging.getLogger(__name__)


class EngineGuard:
    """ASGI middleware: a request without the engine key is a 401 unless its route is open."""

    def __init__(self, app: ASGIApp, key: str | None = None):
        self.app = app
        self._expected = f"Bearer {key or _key_from_environment()}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS and scope.get("method") in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            return await _answer(401, {"error": "this engine answers its front only (the engine key)"}, scope, receive,
                                 send)
        if scope["path"] == RESET_PATH and scope.get("method") == "POST":
            return await _answer(200, {"success": await reset_prefix_cache(scope)}, scope, receive, send)
        return await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)


async def reset_prefix_cache(scope: Scope) -> bool:
    """Empty vLLM's prefix cache; running requests are preempted and computed again (their
    blocks would otherwise keep the reset from happening), so it always succeeds."""
    engine = scope["app"].state.engine_client
    done = await engine.reset_prefix_cache(reset_running_requests=True)
    logger.info("prefix cache reset: %s", done)
    return bool(done)


async def _answer(status: int, body: dict, scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "websocket":
        return await send({"type": "websocket.close", "code": 1008})
    await JSONResponse(body, status_code=status)(scope, receive, send)


def _key_from_environment() -> str:
    from inferscale.secret import engine_key, load_secret

    path = os.environ.get(SECRET_ENV)
    if not path:
        raise RuntimeError(f"{SECRET_ENV} is not set: the engine's launcher names the server secret there")
    return engine_key(load_secret(path))
