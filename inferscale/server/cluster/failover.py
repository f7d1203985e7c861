"""Sending a request with memory to the engine, through a replica's death behind a router.

With ``inferscale serve --engine-url`` the front talks to ``vllm-router`` (or any router)
instead of an engine of its own. Each request carries the user's session key
(:data:`~inferscale.api.SESSION_HEADER`: derived with the server secret, never the user id),
which the router's ``consistent_hash`` policy keeps on one replica, the one holding the user
hot. A replica killed mid-load answers nothing, or the router answers 502/503 for it until its
health checks take it out; the front sends the request again (a generation changes nothing, so
sending it twice is safe) until ``state.engine_retry_s`` has passed, and the router then hashes
the key onto a replica that is up, which faults the user's facts in from the shared store. A
client sees a slower answer, not an error. Streams are retried only before their first byte.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from inferscale.server.engine import forward
from inferscale.server.errors import APIError

logger = logging.getLogger(__name__)

#: the engine's (or router's) answers that mean "no replica answered", worth sending again; a
#: router also answers 500 with a plain-text body when the replica it picked refuses connections
#: (vLLM's own errors are JSON, and are not sent again)
RETRY_STATUSES = frozenset({502, 503, 504})
FIRST_PAUSE_S, MAX_PAUSE_S = 0.2, 2.0


async def post_json(state, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, Any]:
    """(status, answer) of the first attempt that reached a replica, or of the last one."""
    deadline, pause = time.monotonic() + state.engine_retry_s, FIRST_PAUSE_S
    while True:
        try:
            status, answer = await forward.post_json(state.client, path, body, headers)
            if not _no_replica(status, answer) or time.monotonic() >= deadline:
                return status, answer
        except APIError:
            if time.monotonic() >= deadline:
                raise
        pause = await _pause(state, pause)


async def open_stream(state, path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    deadline, pause = time.monotonic() + state.engine_retry_s, FIRST_PAUSE_S
    while True:
        try:
            response = await forward.open_stream(state.client, path, body, headers)
            if response.status_code not in (*RETRY_STATUSES, 500) or time.monotonic() >= deadline:
                return response
            content = await response.aread()
            await response.aclose()
            if not _no_replica(response.status_code, forward.parsed(content)):
                return forward.replayed_response(response, content)
        except APIError:
            if time.monotonic() >= deadline:
                raise
        pause = await _pause(state, pause)


def _no_replica(status: int, answer: Any) -> bool:
    """A router's answer for a replica that is gone (not the engine's own refusal)."""
    if status in RETRY_STATUSES:
        return True
    error = answer.get("error") if isinstance(answer, dict) else None
    return status == 500 and isinstance(error, dict) and error.get("type") == forward.NOT_JSON


async def _pause(state, pause: float) -> float:
    state.metrics.engine_retries.inc()
    logger.info("no replica answered; sending the request again in %.1f s", pause)
    await asyncio.sleep(pause)
    return min(pause * 2, MAX_PAUSE_S)
