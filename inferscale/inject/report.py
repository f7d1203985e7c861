"""What a client is told about its request's memory, and what only the server log gets.

The report returned in the request's output (``kv_transfer_params["inferscale"]``)
must not help anyone who can reach the engine learn about other users' memory:
whether a user or a fact exists, how long a memory segment is, where a prompt
first differs from it, or where files live. So a request that got no memory
is told one coarse code, whatever the reason:

* ``invalid_params``: its ``kv_transfer_params`` are malformed (a property of
  the request alone);
* ``refused``: anything about the stored memory or the salt (unknown user or
  fact, another user's fact, wrong or stale salt, token mismatch, prompt too
  short, unreadable index);
* ``load_error``: the worker could not load memory the scheduler had accepted
  (only a request carrying the right salt gets this far); vLLM recomputed it. Also
  what every request is told when the engine's cache layout was not understood at
  start and nothing is injected (a property of the engine, not of any memory).

The precise reason (:class:`Fallback`) and its
detail go to the server log only; the connector's counters count the coarse code.

A request whose memory was matched is also told the recompute budget it got
(``recompute_budget``: the tail it may have, in tokens; ``recomputed_tokens`` is
what of it whole facts filled) and, when that budget is adaptive, whether the
engine was too busy to spare it (``engine_busy``; None for a fixed budget). Both
are about the request and the engine's load, nothing about stored memory.
"""

from __future__ import annotations

from enum import Enum

INVALID_PARAMS = "invalid_params"
REFUSED = "refused"
LOAD_ERROR = "load_error"
CLIENT_CODES = (INVALID_PARAMS, REFUSED, LOAD_ERROR)


class Fallback(str, Enum):
    """Reasons a request's memory tokens are prefilled normally instead of injected."""

    INVALID_PARAMS = "invalid_params"
    UNKNOWN_USER = "unknown_user"
    UNKNOWN_FACT = "unknown_fact"
    CORRUPT = "corrupt"
    TOKEN_MISMATCH = "token_mismatch"
    MISSING_CACHE_SALT = "missing_cache_salt"
    PROMPT_TOO_SHORT = "prompt_too_short"
    STORE_ERROR = "store_error"
    LOAD_ERROR = "load_error"
    #: the engine's KV cache layout was not understood at start: nothing is injected
    INJECTION_OFF = "injection_off"


def client_code(fallback: Fallback) -> str:
    """The coarse code a client sees for a fallback."""
    if fallback is Fallback.INVALID_PARAMS:
        return INVALID_PARAMS
    if fallback in (Fallback.LOAD_ERROR, Fallback.INJECTION_OFF):
        return LOAD_ERROR
    return REFUSED


def client_report(fallback: Fallback | None, injected_tokens: int, recomputed_tokens: int,
                  recompute_budget: int = 0, room: bool | None = None) -> dict:
    """``{"injected_tokens", "recomputed_tokens", "recompute_budget", "engine_busy", "fallback"}``;
    a fallback reports no token counts and no budget."""
    if fallback is not None:
        return {"injected_tokens": 0, "recomputed_tokens": 0, "recompute_budget": 0, "engine_busy": None,
                "fallback": client_code(fallback)}
    return {"injected_tokens": injected_tokens, "recomputed_tokens": recomputed_tokens,
            "recompute_budget": recompute_budget, "engine_busy": None if room is None else not room, "fallback": None}
