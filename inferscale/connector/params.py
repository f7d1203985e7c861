"""``kv_transfer_params`` of a request: parsing, validation, and the cache salt.

A request asks for memory with::

    {"inferscale": {"user_id": "alice", "fact_ids": ["f-1a2b...", ...]}}

``fact_ids`` are in segment order (first right after the instruction prefix).
Anything else — wrong types, too many facts, duplicate or malformed ids — is
rejected with a reason; the request is then prefilled normally.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inferscale.facts import check_id

PARAMS_KEY = "inferscale"
MAX_FACTS = 1024


class InvalidParams(ValueError):
    """The request's memory parameters are malformed (the reason is the message)."""


@dataclass(frozen=True)
class MemoryRequest:
    user_id: str
    fact_ids: tuple[str, ...]


def parse_params(params: Any) -> MemoryRequest | None:
    """The memory a request asks for; None when it asks for none.

    Raises :class:`InvalidParams` when it asks for memory in a malformed way.
    """
    if params is None:
        return None
    if not isinstance(params, dict):
        raise InvalidParams(f"kv_transfer_params must be a dict, got {type(params).__name__}")
    body = params.get(PARAMS_KEY)
    if body is None:
        return None
    if not isinstance(body, dict):
        raise InvalidParams(f"{PARAMS_KEY!r} must be a dict, got {type(body).__name__}")
    unknown = set(body) - {"user_id", "fact_ids"}
    if unknown:
        raise InvalidParams(f"unknown key(s) {sorted(map(str, unknown))}")
    user_id, fact_ids = body.get("user_id"), body.get("fact_ids")
    try:
        check_id(user_id, "user_id")
    except ValueError as exc:
        raise InvalidParams(str(exc)) from None
    if user_id.startswith("_"):
        raise InvalidParams(f"user_id {user_id!r} is reserved (ids starting with '_' are internal)")
    if not isinstance(fact_ids, (list, tuple)):
        raise InvalidParams(f"fact_ids must be a list, got {type(fact_ids).__name__}")
    if len(fact_ids) > MAX_FACTS:
        raise InvalidParams(f"{len(fact_ids)} fact_ids (at most {MAX_FACTS})")
    for fact_id in fact_ids:
        try:
            check_id(fact_id, "fact_id")
        except ValueError as exc:
            raise InvalidParams(str(exc)) from None
    if len(set(fact_ids)) != len(fact_ids):
        raise InvalidParams("fact_ids contains duplicates")
    return MemoryRequest(user_id, tuple(fact_ids))


def make_params(user_id: str, fact_ids: Sequence[str]) -> dict:
    """The ``kv_transfer_params`` that ask for this memory."""
    return {PARAMS_KEY: {"user_id": user_id, "fact_ids": list(fact_ids)}}


def segment_salt(user_id: str, segment_token_ids: Sequence[int]) -> str:
    """The ``cache_salt`` a request with injected memory must carry.

    Injected KV is approximate (facts were encoded apart), so vLLM's prefix
    cache must never serve it to a plain request with the same tokens. The
    salt keys the cache by user and exact segment, so identical memory still
    hits the prefix cache while plain requests never do.
    """
    digest = hashlib.sha256(user_id.encode())
    digest.update(b"\x00")
    digest.update(",".join(map(str, segment_token_ids)).encode())
    return f"inferscale-{digest.hexdigest()[:32]}"
