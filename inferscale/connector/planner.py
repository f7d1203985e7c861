"""Scheduler side, vLLM-free: decide how many prompt tokens a request's memory covers.

The planner reads the segment's token ids through the disk store (whose
index cache serves them until the user's file changes; the first read of a
user verifies the whole file, K/V included), and claims memory tokens only
when the prompt starts with exactly the segment's tokens, the request
carries the segment's cache salt, and at least one prompt token is left to
compute. It claims the segment's head: the whole facts at the tail that fit
in the recompute budget are left to vLLM (:mod:`inferscale.compose.blend`).
Planning is side-effect free: vLLM may ask twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inferscale.compose.blend import Blend, injected_length
from inferscale.compose.segment import segment_parts
from inferscale.compose.request import InvalidParams, SegmentRequest, parse_params
from inferscale.connector.stats import Fallback
from inferscale.errors import CorruptDataError, MissingFactError, UnknownUserError
from inferscale.storage.base import KVStore


@dataclass(frozen=True)
class Plan:
    """What to do with one request.

    The segment's first ``claim_len`` tokens are injected (the worker loads
    the ``num_external`` of them that vLLM's own prefix cache does not hold);
    the remaining ``segment_len - claim_len`` are recomputed by vLLM.
    """

    request: SegmentRequest | None
    segment_len: int = 0
    num_external: int = 0
    salt: str = ""
    fallback: Fallback | None = None
    detail: str = ""
    claim_len: int = 0
    blend: Blend = Blend()

    @property
    def recomputed(self) -> int:
        """Memory tokens vLLM prefills as ordinary tokens."""
        return self.segment_len - self.claim_len


NO_MEMORY = Plan(request=None)


def plan_request(
    store: KVStore,
    prompt_token_ids: Sequence[int],
    params: Any,
    cache_salt: str | None,
    num_computed_tokens: int,
    blend: Blend = Blend(),
) -> Plan:
    """Match a request against its memory segment; ``blend`` holds the
    connector's defaults, which the request's own values override."""
    try:
        request = parse_params(params)
    except InvalidParams as exc:
        return Plan(None, fallback=Fallback.INVALID_PARAMS, detail=str(exc))
    if request is None:
        return NO_MEMORY
    try:
        parts = segment_parts(store, request.user_id, request.fact_ids)
    except UnknownUserError as exc:
        return Plan(request, fallback=Fallback.UNKNOWN_USER, detail=str(exc))
    except MissingFactError as exc:
        return Plan(request, fallback=Fallback.UNKNOWN_FACT, detail=str(exc))
    except CorruptDataError as exc:
        return Plan(request, fallback=Fallback.CORRUPT, detail=str(exc))
    except (OSError, ValueError) as exc:
        return Plan(request, fallback=Fallback.STORE_ERROR, detail=f"{type(exc).__name__}: {exc}")
    blend = blend.override(request.recompute_tokens, request.key_scale)
    return _match(request, parts, list(prompt_token_ids), cache_salt, num_computed_tokens, blend)


def _match(request: SegmentRequest, parts: list[tuple[int, ...]], prompt: list[int], cache_salt: str | None,
           num_computed: int, blend: Blend) -> Plan:
    segment = [t for part in parts for t in part]
    m = len(segment)
    if len(prompt) <= m:
        return Plan(request, m, fallback=Fallback.PROMPT_TOO_SHORT,
                    detail=f"prompt has {len(prompt)} tokens, memory segment {m}: nothing left to compute")
    if prompt[:m] != segment:
        first = next(i for i, (a, b) in enumerate(zip(prompt, segment)) if a != b)
        return Plan(request, m, fallback=Fallback.TOKEN_MISMATCH,
                    detail=f"prompt differs from the memory segment at token {first} of {m}")
    salt = request.salt(segment)
    if not salt_matches(cache_salt, salt):
        return Plan(request, m, salt=salt, fallback=Fallback.MISSING_CACHE_SALT,
                    detail="request lacks the segment's cache_salt (inferscale.compose.request.segment_salt)")
    claim = injected_length([len(p) for p in parts], blend.recompute_tokens)
    return Plan(request, m, num_external=max(0, claim - num_computed), salt=salt, claim_len=claim, blend=blend)


def salt_matches(cache_salt: str | None, salt: str) -> bool:
    """The request's salt is the segment's, optionally with a ``:suffix`` (a
    client that wants no prefix-cache reuse at all adds a nonce)."""
    return cache_salt is not None and (cache_salt == salt or cache_salt.startswith(salt + ":"))
