"""Caps on request bodies, per route: a larger one is refused with a 413 before it is held in
memory or parsed.

Every route reads its body whole and parses it as JSON, and parsing costs by structure, not
by size: 30 MB of ``[],[],...`` takes seconds of a core (and of the GIL, so every other request
of the front waits), while 30 MB of one string takes milliseconds. So each route's cap is what
its largest legitimate body can take, from the field limits it checks after parsing, at 6
bytes a character (JSON's ``\\uXXXX`` escape; UTF-8 takes at most 4) plus room for the
structure:

- ``POST /v1/chat/completions``: messages of 1 MiB of text together (``chat.MAX_CHAT_CHARS``) → 8 MiB;
- ``POST /v1/memories``: 100,000 characters of facts, 200,000 of messages, their turn ids → 4 MiB;
- every other memory route (search, update; the rest take no body) → 64 KiB;
- the engine's routes passed through (``/v1/completions`` with a context of token ids,
  ``/v1/embeddings`` of a batch) → 32 MiB.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferscale.server.errors import error_response

MAX_BODY_BYTES = 32 << 20
CHAT_BODY_BYTES = 8 << 20
ADD_BODY_BYTES = 4 << 20
SMALL_BODY_BYTES = 64 << 10
#: the front's own routes (exact path, or a prefix ending in "/"), the first that matches wins
ROUTE_CAPS = (("POST", "/v1/chat/completions", CHAT_BODY_BYTES), ("POST", "/v1/memories", ADD_BODY_BYTES),
              (None, "/v1/memories", SMALL_BODY_BYTES), (None, "/v1/memories/", SMALL_BODY_BYTES),
              (None, "/v1/users", SMALL_BODY_BYTES))


def body_cap(method: str, path: str) -> int:
    """The most bytes a request's body may have on this route."""
    path = path.rstrip("/") or "/"
    for cap_method, route, cap in ROUTE_CAPS:
        if (cap_method is None or cap_method == method) and (path == route.rstrip("/") or
                                                             (route.endswith("/") and path.startswith(route))):
            return cap
    return MAX_BODY_BYTES


def too_large(max_bytes: int) -> str:
    size = f"{max_bytes >> 20} MiB" if max_bytes >= 1 << 20 else f"{max_bytes >> 10} KiB"
    return f"the request body is larger than {size}, this route's limit"


class BodyLimit:
    """ASGI middleware: a declared ``Content-Length`` over the route's cap is answered 413 at
    once; a body sent without one stops being read when it passes the cap (413 through the
    app's handler)."""

    def __init__(self, app: ASGIApp, caps=body_cap):
        self.app, self.caps = app, caps

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        max_bytes = self.caps(scope["method"], scope["path"])
        if _declared_length(scope) > max_bytes:
            return await error_response(413, too_large(max_bytes))(scope, receive, send)
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > max_bytes:
                raise HTTPException(413, too_large(max_bytes))
            return message

        await self.app(scope, counted, send)


def _declared_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0  # the server refuses a malformed length itself
    return 0
