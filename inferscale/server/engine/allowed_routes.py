"""Which of the engine's routes the front passes through: an allow-list of normalized paths.

A path is percent-decoded (until it no longer changes) and its dot-segments resolved
before it is matched, and it is forwarded as the allow-listed path itself, never as the
client wrote it: ``/v1/../load``, ``/v1/%2e%2e/load`` and ``/v1/..%2Fload`` all normalize
to ``/load``, which is not listed, and are answered 404 by the front. vLLM's admin routes
(``/load``, ``/sleep``, ``/wake_up``, ``/reset_prefix_cache``, ``/scale_elastic_ep``,
``/collective_rpc``, ``/start_profile``, ``/v1/load_lora_adapter``, ``/openapi.json``,
``/docs``, ...) are never reachable through the front.
"""

from __future__ import annotations

import posixpath
from urllib.parse import unquote

#: path → the methods the front passes on for it
ALLOWED = {
    "/v1/models": ("GET",),
    "/v1/completions": ("POST",),
    "/v1/embeddings": ("POST",),
    "/tokenize": ("POST",),
    "/detokenize": ("POST",),
    "/version": ("GET",),
}
#: percent-decoding rounds before a path is refused as obfuscated
MAX_DECODES = 4


def normalized(path: str) -> str | None:
    """``path`` decoded and with ``.``/``..`` resolved; None for one that cannot be a route
    (still encoded after :data:`MAX_DECODES` rounds, NUL or backslash in it, not absolute)."""
    for _ in range(MAX_DECODES):
        decoded = unquote(path, errors="strict")
        if decoded == path:
            break
        path = decoded
    else:
        return None
    if not path.startswith("/") or "\\" in path or "\x00" in path:
        return None
    resolved = posixpath.normpath(path)
    return "/" + resolved.lstrip("/")


def allowed_route(path: str, method: str) -> str | None:
    """The engine path to forward to, or None when the front does not pass this request on."""
    try:
        route = normalized(path)
    except UnicodeDecodeError:
        return None
    if route is None or method not in ALLOWED.get(route, ()):
        return None
    return route
