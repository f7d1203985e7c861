"""The session key a router keeps a user's requests on one replica by.

Routers hash a request header onto their workers (``vllm-router``'s ``consistent_hash``,
llm-d's session affinity and NVIDIA Dynamo's session routing read ``X-Session-ID``). The key
is derived from the user id with the server secret, so a header never carries the user id,
and no one without the secret can tell whose requests share a key, nor steer a user elsewhere.
"""

from __future__ import annotations

import hashlib
import hmac

SESSION_HEADER = "X-Session-ID"
_LABEL = b"inferscale session\0"


def session_key(secret: bytes, user_id: str) -> str:
    """``s-`` and 32 hex digits: HMAC-SHA256 of the user id under the server secret."""
    return "s-" + hmac.new(secret, _LABEL + user_id.encode(), hashlib.sha256).hexdigest()[:32]
