"""Errors as OpenAI-shaped JSON: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal is a clear 4xx that says what was wrong; nothing a client sends
makes the server answer 500 or show a path, a stack or another user's data
(details of a server-side failure go to the log, under a reference id).
"""

from __future__ import annotations

import json
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from inferscale.errors import (
    ConfigError,
    CorruptDataError,
    InferScaleError,
    MissingFactError,
    ModelMismatchError,
    StoreUnavailableError,
    UnknownUserError,
)

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error", 502: "engine_error", 503: "unavailable_error"}


class APIError(Exception):
    """A refusal with an HTTP status and a message for the client."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """``headers``: e.g. a 405's ``Allow``."""
    body = {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def from_library(exc: InferScaleError) -> APIError:
    """The HTTP answer to a library error (no server path or internals in the message)."""
    if isinstance(exc, (UnknownUserError, MissingFactError)):
        return APIError(404, str(exc))
    if isinstance(exc, (CorruptDataError, ModelMismatchError)):
        ref = _log_internal(exc)
        return APIError(500, f"the stored memory could not be read (reference {ref}); see the server log")
    if isinstance(exc, ConfigError):
        return APIError(400, str(exc))
    if isinstance(exc, StoreUnavailableError):
        ref = _log_internal(exc)
        return APIError(503, f"store_unavailable: the memory store did not answer (reference {ref}); "
                             f"nothing was written, try again")
    ref = _log_internal(exc)
    return APIError(500, f"internal error (reference {ref}); see the server log")


def install(app: FastAPI) -> None:
    """Answer every error as OpenAI-shaped JSON."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(InferScaleError)
    async def _library_error(request: Request, exc: InferScaleError):
        err = from_library(exc)
        return error_response(err.status, err.message, err.param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):  # FastAPI's and Starlette's own refusals
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(400, validation_message(exc.errors()))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        ref = _log_internal(exc)
        return error_response(500, f"internal error (reference {ref}); see the server log")


def validation_message(errors) -> str:
    """One line per problem: ``field: what is wrong``."""
    parts = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        if err.get("type") == "json_invalid":
            return f"the request body is not valid JSON ({err.get('msg', '')})"
        if tuple(err.get("loc", ())) == ("body",) and err.get("type") in ("model_attributes_type", "dict_type"):
            return "the request body must be a JSON object (Content-Type: application/json)"
        message = err.get("msg", "invalid")
        if err.get("type") == "value_error":  # a validator's own message, without pydantic's "Value error, "
            message = str(err.get("ctx", {}).get("error", message))
        parts.append(f"{where}: {message}")
    return "; ".join(parts) or "invalid request"


def json_body(raw: bytes) -> dict:
    """A request body that must be a JSON object, of JSON as the standard has it: no NaN or
    Infinity, no text that is not Unicode (a lone ``\\ud800``), nesting Python can parse, and
    no key twice in one object (parsers disagree on which one wins)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
        json.dumps(body, ensure_ascii=False).encode()  # what the engine will be sent
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON (nested too deeply)") from None
    except UnicodeEncodeError:
        raise APIError(400, "the request body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                            "not in a pair), which is not text") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    body = dict(pairs)
    if len(body) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the key {twice[:60]!r} appears twice in one object")
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _log_internal(exc: BaseException) -> str:
    ref = uuid.uuid4().hex[:12]
    logger.error("internal error %s: %s: %s", ref, type(exc).__name__, exc, exc_info=exc)
    return ref
