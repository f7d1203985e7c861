"""Cache salts: the key of vLLM's prefix cache for a request, which no client can compute.

vLLM reuses cached K/V blocks across requests with the same ``cache_salt`` and
the same leading tokens. Injected K/V is approximate and belongs to one user,
so a salt must (1) differ between users and between memories, and (2) be
unknowable to anyone who could send a request to the engine directly: the
connector injects memory only into a request carrying the right salt, and
only that request's salt reads the blocks back from the prefix cache.

A salt is HMAC-SHA256, keyed with the server secret (:mod:`inferscale.secret`),
over the user, the user's *epoch* (the id of their stored memory's version,
renewed on every write and never reused, :meth:`KVStore.epoch`), and, for
injected memory, the segment's token ids and recipe (recompute budget, key
scale). Deleting, updating or re-encoding a user's memory changes the epoch,
so salts issued before never match again; prompt-mode requests (facts as text)
are salted per user and epoch too, so users never share cached blocks.
"""

from __future__ import annotations

import functools
import hmac
import json
import os
import sys
from array import array
from collections.abc import Sequence

PREFIX = "inferscale-"
_BIG_ENDIAN = sys.byteorder == "big"
#: hex digits kept from the HMAC (128 bits)
DIGITS = 32


class CacheSalts:
    """Computes cache salts with one secret key."""

    def __init__(self, secret: bytes):
        if not isinstance(secret, bytes) or not secret:
            raise ValueError("a cache salt key must be non-empty bytes")
        self._key = secret

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> CacheSalts:
        """Keyed with the server secret in ``path`` (created on first use), e.g. ``config.secret_path``."""
        from inferscale.secret import load_secret

        return cls(load_secret(path))

    def segment(self, user_id: str, epoch: str, token_ids: Sequence[int], recompute_tokens: int | None = None,
                key_scale: float | None = None) -> str:
        """The salt of a request with injected memory: this user, epoch, segment and recipe."""
        # the token ids as little-endian int64 after a JSON head: a thousand-token segment is
        # hashed in microseconds (the scheduler does it on every request)
        tokens = array("q", token_ids)
        if _BIG_ENDIAN:
            tokens.byteswap()
        head = _segment_head(user_id, epoch, len(tokens), recompute_tokens,
                             None if key_scale is None else float(key_scale))
        return self._mac(head + tokens.tobytes())

    def text(self, user_id: str, epoch: str) -> str:
        """The salt of a prompt-mode request (the user's facts as text)."""
        return self._mac(_json_line(["text", user_id, epoch]))

    def _mac(self, message: bytes) -> str:
        return PREFIX + hmac.digest(self._key, message, "sha256").hex()[:DIGITS]

    def __repr__(self) -> str:  # never print the key
        return "CacheSalts(<secret>)"


def _json_line(fields: list) -> bytes:
    return json.dumps(fields, separators=(",", ":")).encode() + b"\n"


@functools.lru_cache(maxsize=4096, typed=True)
def _segment_head(user_id: str, epoch: str, num_tokens: int, recompute_tokens: int | None,
                  key_scale: float | None) -> bytes:
    """The head of a segment salt's message, remembered: the requests of one version of a user's
    memory with the same length and recipe share it (it holds no secret)."""
    return _json_line(["segment", user_id, epoch, num_tokens, [recompute_tokens, key_scale]])
