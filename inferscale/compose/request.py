"""``kv_transfer_params`` of a request: parsing, validation, and the cache salt.

A request asks for memory with::

    {"inferscale": {"user_id": "alice", "fact_ids": ["f-1a2b...", ...],
                    "recompute_tokens": 256, "key_scale": 1.0,
                    "epoch": "...", "segment_tokens": 171}}

``fact_ids`` are in segment order (first right after the instruction prefix).
``recompute_tokens`` and ``key_scale`` are optional and override the
connector's configured defaults for this request (see
:mod:`inferscale.compose.blend`). ``epoch`` and ``segment_tokens`` (the user's
epoch and the segment's length when the server made the request; the server
always sends them) let the connector check the salt against the prompt's head
before it looks the user or a fact up, so a forged request learns nothing from
how it is refused. Anything else — wrong types, too many facts,
duplicate or malformed ids, out-of-range values — is rejected with a reason;
the request is then prefilled normally.

The request's ``cache_salt`` is computed apart, with the server secret
(:mod:`inferscale.compose.salt`): :meth:`SegmentRequest.salt`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inferscale.compose.salt import CacheSalts
from inferscale.facts import check_id_list, check_request_user_id

PARAMS_KEY = "inferscale"
MAX_FACTS = 1024
MAX_RECOMPUTE_TOKENS = 1 << 20
KEY_SCALE_RANGE = (0.25, 4.0)
MAX_EPOCH_CHARS = 64
KEYS = frozenset(("user_id", "fact_ids", "recompute_tokens", "key_scale", "epoch", "segment_tokens"))


class InvalidParams(ValueError):
    """The request's memory parameters are malformed (the reason is the message)."""


@dataclass(frozen=True)
class SegmentRequest:
    user_id: str
    fact_ids: tuple[str, ...]
    recompute_tokens: int | None = None  # None: the connector's default
    key_scale: float | None = None  # None: the connector's default
    epoch: str | None = None  # the user's epoch the server made the request at
    segment_tokens: int | None = None  # the memory segment's length in tokens (with ``epoch``)

    def salt_of_head(self, salts: CacheSalts, prompt_token_ids: Sequence[int]) -> str | None:
        """The salt the prompt's first ``segment_tokens`` would have at ``epoch``, computed from
        the request alone (no store read); None when the request does not carry them."""
        if self.epoch is None or self.segment_tokens is None:
            return None
        return self.salt(salts, self.epoch, prompt_token_ids[: self.segment_tokens])

    def salt(self, salts: CacheSalts, epoch: str, segment_token_ids: Sequence[int]) -> str:
        """The cache salt this request must carry for a segment of these tokens,
        made from the user's memory at ``epoch`` (:meth:`KVStore.epoch`)."""
        return salts.segment(self.user_id, epoch, segment_token_ids, self.recompute_tokens, self.key_scale)


def parse_params(params: Any) -> SegmentRequest | None:
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
    unknown = set(body) - KEYS
    if unknown:
        raise InvalidParams(f"unknown key(s) {sorted(str(k)[:40] for k in unknown)[:5]}")
    user_id, fact_ids = body.get("user_id"), body.get("fact_ids")
    try:
        user_id = check_request_user_id(user_id)  # in NFC, as the server made the salt with it
    except ValueError as exc:
        raise InvalidParams(str(exc)) from None
    if not isinstance(fact_ids, (list, tuple)):
        raise InvalidParams(f"fact_ids must be a list, got {type(fact_ids).__name__}")
    if len(fact_ids) > MAX_FACTS:
        raise InvalidParams(f"{len(fact_ids)} fact_ids (at most {MAX_FACTS})")
    try:
        check_id_list(fact_ids, "fact_id")
    except ValueError as exc:
        raise InvalidParams(str(exc)) from None
    if len(set(fact_ids)) != len(fact_ids):
        raise InvalidParams("fact_ids contains duplicates")
    budget, scale = body.get("recompute_tokens"), body.get("key_scale")
    epoch, length = _check_version(body.get("epoch"), body.get("segment_tokens"))
    return SegmentRequest(user_id, tuple(fact_ids), _check_budget(budget), _check_scale(scale), epoch, length)


def _check_version(epoch: Any, length: Any) -> tuple[str | None, int | None]:
    if epoch is None and length is None:
        return None, None
    if not isinstance(epoch, str) or not 0 < len(epoch) <= MAX_EPOCH_CHARS:
        raise InvalidParams(f"epoch must be a string of 1..{MAX_EPOCH_CHARS} characters, with segment_tokens")
    if isinstance(length, bool) or not isinstance(length, int) or not 0 < length <= MAX_RECOMPUTE_TOKENS:
        raise InvalidParams(f"segment_tokens must be an integer in 1..{MAX_RECOMPUTE_TOKENS}, with epoch")
    return epoch, length


def _check_budget(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RECOMPUTE_TOKENS:
        raise InvalidParams(f"recompute_tokens must be an integer in 0..{MAX_RECOMPUTE_TOKENS}, got {value!r}")
    return value


def _check_scale(value: Any) -> float | None:
    if value is None:
        return None
    low, high = KEY_SCALE_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise InvalidParams(f"key_scale must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def make_params(user_id: str, fact_ids: Sequence[str], recompute_tokens: int | None = None,
                key_scale: float | None = None, epoch: str | None = None, segment_tokens: int | None = None) -> dict:
    """The ``kv_transfer_params`` that ask for this memory (None: the connector's default)."""
    body: dict[str, Any] = {"user_id": user_id, "fact_ids": list(fact_ids)}
    if epoch is not None:
        body["epoch"], body["segment_tokens"] = epoch, segment_tokens
    if recompute_tokens is not None:
        body["recompute_tokens"] = recompute_tokens
    if key_scale is not None:
        body["key_scale"] = key_scale
    return {PARAMS_KEY: body}
