"""Scheduler side, vLLM-free: decide how many prompt tokens a request's memory covers.

The planner reads the segment's token ids and the user's epoch from the disk
store's index (never the K/V: the worker verifies those when it reads them),
and claims memory tokens only when the request carries the segment's cache
salt (keyed with the server secret, :mod:`inferscale.compose.salt`), the
prompt starts with exactly the segment's tokens, and at least one prompt
token is left to compute. It claims the segment's head: the whole facts at
the tail that fit in the recompute budget are left to vLLM
(:mod:`inferscale.compose.blend`); an adaptive budget is spent only when the
caller says the engine has room (``room``, :mod:`inferscale.inject.load_signal`).
Planning is side-effect free: vLLM may ask twice. Each refusal carries a reason for
the server log; the client is told less (:mod:`inferscale.inject.report`). Every
request has its salt checked against the prompt's head first, before the user or a
fact is told apart: a forged one is refused the same way, at the same cost, whether
the user, the facts or neither exist. A request that carries its epoch and segment
length (every request the server makes) is checked with no store read; one built by
hand without them, with the store's current epoch and fact lengths, read alike for
stored and unknown ids.
"""

from __future__ import annotations

import hmac
from itertools import chain
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from inferscale.compose.blend import Blend, injected_length
from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER, segment_parts
from inferscale.compose.request import InvalidParams, SegmentRequest, parse_params
from inferscale.compose.salt import CacheSalts
from inferscale.inject.report import Fallback
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
    #: the epochs of the instruction prefix and of the user's memory it was matched against
    epochs: tuple[str, str] = ("", "")
    fallback: Fallback | None = None
    detail: str = ""
    claim_len: int = 0
    blend: Blend = Blend()
    #: the recompute budget chosen for this request (tokens), and whether the engine had room for
    #: an adaptive one (None: the budget is fixed)
    budget: int = 0
    room: bool | None = None

    @property
    def recomputed(self) -> int:
        """Memory tokens vLLM prefills as ordinary tokens."""
        return self.segment_len - self.claim_len


NO_MEMORY = Plan(request=None)
#: the epoch a hand-built request's salt is checked with when its user has none (no real epoch:
#: those are 32 hex digits)
NO_EPOCH = "none"


def plan_request(
    store: KVStore,
    salts: CacheSalts,
    prompt_token_ids: Sequence[int],
    params: Any,
    cache_salt: str | None,
    num_computed_tokens: int,
    blend: Blend = Blend(),
    room: Callable[[], bool] = lambda: True,
) -> Plan:
    """Match a request against its memory segment; ``salts`` computes the salt it
    must carry; ``blend`` holds the connector's defaults, which the request's own
    values override; ``room()`` says whether the engine has room for an adaptive
    tail (asked only for a request whose memory matched, with an adaptive budget)."""
    try:
        request = parse_params(params)
    except InvalidParams as exc:
        return Plan(None, fallback=Fallback.INVALID_PARAMS, detail=str(exc))
    if request is None:
        return NO_MEMORY
    prompt = prompt_token_ids if isinstance(prompt_token_ids, list) else list(prompt_token_ids)
    if not salt_matches(cache_salt, _head_salt(store, salts, request, prompt)):  # nothing told apart before
        return Plan(request, fallback=Fallback.MISSING_CACHE_SALT,
                    detail="request lacks the cache_salt of its prompt's head (not made by this server)")
    try:
        epochs, parts = segment_parts(store, request.user_id, request.fact_ids)
    except UnknownUserError as exc:
        return Plan(request, fallback=Fallback.UNKNOWN_USER, detail=str(exc))
    except MissingFactError as exc:
        return Plan(request, fallback=Fallback.UNKNOWN_FACT, detail=str(exc))
    except CorruptDataError as exc:
        return Plan(request, fallback=Fallback.CORRUPT, detail=str(exc))
    except (OSError, ValueError) as exc:
        return Plan(request, fallback=Fallback.STORE_ERROR, detail=f"{type(exc).__name__}: {exc}")
    blend = blend.override(request.recompute_tokens, request.key_scale)
    segment = list(chain.from_iterable(parts))
    salt = request.salt(salts, epochs[1], segment)
    plan = _match(request, segment, prompt, cache_salt, salt, epochs, blend)
    if plan.fallback is not None:
        return plan
    return with_tail(plan, parts, num_computed_tokens, room() if blend.adaptive else None)


def _head_salt(store: KVStore, salts: CacheSalts, request: SegmentRequest, prompt: list[int]) -> str:
    """The salt the prompt's head must carry. A server-made request names its epoch and segment
    length: no store read. A hand-built one is checked against the store's current version of
    its segment, read at one cost whether the user and its facts exist or not (a stand-in epoch,
    a length of 0), so that neither the answer nor the time it took tells them apart."""
    head = request.salt_of_head(salts, prompt)
    if head is not None:
        return head
    try:
        _, (prefix,) = store.stored_lengths(SYSTEM_USER, [PREFIX_FACT])
        epoch, lengths = store.stored_lengths(request.user_id, request.fact_ids)
    except (CorruptDataError, OSError, ValueError):
        epoch, prefix, lengths = None, 0, []
    return request.salt(salts, epoch or NO_EPOCH, prompt[: prefix + sum(lengths)])


def _match(request: SegmentRequest, segment: list[int], prompt: list[int], cache_salt: str | None, salt: str,
           epochs: tuple[str, str], blend: Blend) -> Plan:
    m = len(segment)
    if not salt_matches(cache_salt, salt):  # checked first: a request without it learns nothing more
        return Plan(request, m, fallback=Fallback.MISSING_CACHE_SALT,
                    detail="request lacks the segment's cache_salt (stale epoch, or not made by this server)")
    if len(prompt) <= m:
        return Plan(request, m, fallback=Fallback.PROMPT_TOO_SHORT,
                    detail=f"prompt has {len(prompt)} tokens, memory segment {m}: nothing left to compute")
    if prompt[:m] != segment:
        first = next(i for i, (a, b) in enumerate(zip(prompt, segment)) if a != b)
        return Plan(request, m, fallback=Fallback.TOKEN_MISMATCH,
                    detail=f"prompt differs from the memory segment at token {first} of {m}")
    return Plan(request, m, epochs=epochs, blend=blend)


def with_tail(plan: Plan, parts: list[tuple[int, ...]], num_computed: int, room: bool | None) -> Plan:
    """A matched plan with its claim: all but the whole tail facts that fit in the request's budget
    (``room``: whether the engine has room for an adaptive one; None for a fixed one)."""
    budget = plan.blend.budget(room)
    claim = injected_length([len(p) for p in parts], budget)
    return replace(plan, num_external=max(0, claim - num_computed), claim_len=claim, budget=budget, room=room)


def salt_matches(cache_salt: str | None, salt: str) -> bool:
    """The request's salt is the segment's, optionally with a ``:suffix`` (a
    client that wants no prefix-cache reuse at all adds a nonce); compared in
    constant time."""
    if not isinstance(cache_salt, str):
        return False
    head, rest = cache_salt[: len(salt)], cache_salt[len(salt):]
    return hmac.compare_digest(head.encode(), salt.encode()) and (rest == "" or rest.startswith(":"))
