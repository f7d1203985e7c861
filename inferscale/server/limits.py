"""A cap on request bodies: a larger one is refused with a 413 before it is held in memory.

Every route reads its body whole (JSON), so without a cap one request could make the front
buffer gigabytes. The largest legitimate bodies are far below it: 256 facts of 2,000
characters, or 200 messages of 20,000 characters, or a conversation filling the context.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferscale.server.errors import error_response

MAX_BODY_BYTES = 32 << 20


def too_large(max_bytes: int) -> str:
    return f"the request body is larger than {max_bytes >> 20} MiB"


class BodyLimit:
    """ASGI middleware: a declared ``Content-Length`` over the cap is answered 413 at once; a
    body sent without one stops being read when it passes the cap (413 through the app's handler)."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if _declared_length(scope) > self.max_bytes:
            return await error_response(413, too_large(self.max_bytes))(scope, receive, send)
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, too_large(self.max_bytes))
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
