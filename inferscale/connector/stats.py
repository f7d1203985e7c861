"""Why requests fell back to normal prefill, counted."""

from __future__ import annotations

import threading
from collections import Counter
from enum import Enum


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


class ConnectorStats:
    """Thread-safe counters: injected requests/tokens and fallbacks by reason."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def record_injection(self, num_tokens: int) -> None:
        with self._lock:
            self.counts["injected_requests"] += 1
            self.counts["injected_tokens"] += num_tokens

    def record_fallback(self, reason: Fallback) -> None:
        with self._lock:
            self.counts[f"fallback.{reason.value}"] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)
