"""Reading a request's JSON body: strictly (:func:`errors.json_body`), off the event loop when large.

Every route that takes a JSON body reads it here, so one rule holds everywhere: a body that
is not JSON as the standard has it, or names a key twice, is a 400 before any route sees it.
A large body is parsed in a worker thread, so that one client's megabytes never stall the
requests of the others.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ValidationError

from inferscale.server.errors import APIError, json_body, validation_message

#: bodies larger than this are parsed in a worker thread
PARSE_INLINE_BYTES = 64 << 10
Model = TypeVar("Model", bound=BaseModel)


async def read_json(request: Request) -> dict:
    raw = await request.body()
    if len(raw) <= PARSE_INLINE_BYTES:
        return json_body(raw)
    return await run_in_threadpool(json_body, raw)


def model_body(model: type[Model]) -> Callable[[Request], Awaitable[Model]]:
    """A FastAPI dependency: the body read by :func:`read_json`, validated as ``model``."""

    async def parsed(request: Request) -> Model:
        body = await read_json(request)
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            raise APIError(400, validation_message(exc.errors())) from None

    return parsed
