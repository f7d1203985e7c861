"""Scheduler side, vLLM-free: decide how many prompt tokens a request's memory covers.

The planner reads only token ids (never K/V) from the disk tier, and claims the
memory tokens only when the prompt starts with exactly the segment's tokens,
the request carries the segment's cache salt, and at least one prompt token
is left to compute. Planning is side-effect free: vLLM may ask twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inferscale.compose.segment import segment_token_ids
from inferscale.connector.params import InvalidParams, MemoryRequest, parse_params, segment_salt
from inferscale.connector.stats import Fallback
from inferscale.errors import CorruptDataError, MissingFactError, UnknownUserError
from inferscale.storage.base import KVStore


@dataclass(frozen=True)
class Plan:
    """What to do with one request. ``num_external`` tokens are loaded by the worker."""

    memory: MemoryRequest | None
    segment_len: int = 0
    num_external: int = 0
    salt: str = ""
    fallback: Fallback | None = None
    detail: str = ""


NO_MEMORY = Plan(memory=None)


def plan_request(
    catalog: KVStore,
    prompt_token_ids: Sequence[int],
    params: Any,
    cache_salt: str | None,
    num_computed_tokens: int,
) -> Plan:
    """Match a request against its memory segment."""
    try:
        memory = parse_params(params)
    except InvalidParams as exc:
        return Plan(None, fallback=Fallback.INVALID_PARAMS, detail=str(exc))
    if memory is None:
        return NO_MEMORY
    try:
        segment = segment_token_ids(catalog, memory.user_id, memory.fact_ids)
    except UnknownUserError as exc:
        return Plan(memory, fallback=Fallback.UNKNOWN_USER, detail=str(exc))
    except MissingFactError as exc:
        return Plan(memory, fallback=Fallback.UNKNOWN_FACT, detail=str(exc))
    except CorruptDataError as exc:
        return Plan(memory, fallback=Fallback.CORRUPT, detail=str(exc))
    except (OSError, ValueError) as exc:
        return Plan(memory, fallback=Fallback.STORE_ERROR, detail=f"{type(exc).__name__}: {exc}")
    return _match(memory, segment, list(prompt_token_ids), cache_salt, num_computed_tokens)


def _match(memory: MemoryRequest, segment: list[int], prompt: list[int], cache_salt: str | None, num_computed: int) -> Plan:
    m = len(segment)
    if len(prompt) <= m:
        return Plan(memory, m, fallback=Fallback.PROMPT_TOO_SHORT,
                    detail=f"prompt has {len(prompt)} tokens, memory segment {m}: nothing left to compute")
    if prompt[:m] != segment:
        first = next(i for i, (a, b) in enumerate(zip(prompt, segment)) if a != b)
        return Plan(memory, m, fallback=Fallback.TOKEN_MISMATCH,
                    detail=f"prompt differs from the memory segment at token {first} of {m}")
    salt = segment_salt(memory.user_id, segment)
    if not salt_matches(cache_salt, salt):
        return Plan(memory, m, salt=salt, fallback=Fallback.MISSING_CACHE_SALT,
                    detail="request lacks the segment's cache_salt (inferscale.connector.params.segment_salt)")
    return Plan(memory, m, num_external=max(0, m - num_computed), salt=salt)


def salt_matches(cache_salt: str | None, salt: str) -> bool:
    """The request's salt is the segment's, optionally with a ``:suffix`` (a
    client that wants no prefix-cache reuse at all adds a nonce)."""
    return cache_salt is not None and (cache_salt == salt or cache_salt.startswith(salt + ":"))
