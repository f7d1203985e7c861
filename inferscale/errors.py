"""User-facing exceptions. Each message says what was asked for and what exists."""

from __future__ import annotations

from collections.abc import Iterable


class InferScaleError(Exception):
    """Base class of every error InferScale raises on purpose."""


class UnsupportedReleaseError(InferScaleError):
    """The installed vLLM is a release InferScale was not tested with."""


class ConfigError(InferScaleError, ValueError):
    """A configuration value is missing, malformed or of the wrong type."""


class UnknownBackendError(ConfigError):
    """A config names a backend that no registered plugin provides."""

    def __init__(self, kind: str, name: str, known: Iterable[str]):
        self.kind, self.name, self.known = kind, name, sorted(known)
        listing = ", ".join(self.known) or "none registered"
        super().__init__(f"{kind} {name!r} is not registered — known: {listing}")


class PluginError(InferScaleError):
    """A plugin failed to load or registered something invalid."""


class UnknownUserError(InferScaleError, KeyError):
    """No memory is stored for this user."""

    def __init__(self, user_id: str):
        self.user_id = user_id
        super().__init__(f"no memory stored for user {user_id!r}")

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class MissingFactError(InferScaleError, KeyError):
    """Some fact_ids are not stored for this user."""

    def __init__(self, user_id: str, missing: Iterable[str]):
        self.user_id, self.missing = user_id, sorted(missing)
        shown = ", ".join(self.missing[:5]) + (" ..." if len(self.missing) > 5 else "")
        super().__init__(f"user {user_id!r} has no fact(s) {shown}")

    def __str__(self) -> str:
        return self.args[0]


class CorruptDataError(InferScaleError):
    """Stored data failed its integrity check; it is never returned as KV."""


class CapacityError(InferScaleError):
    """A user's K/V does not fit in a memory store's byte budget (``max_bytes``)."""


class ModelMismatchError(InferScaleError, ValueError):
    """Stored KV does not fit the model it is asked to serve (layers, heads, head size)."""


class StoreUnavailableError(InferScaleError, ConnectionError):
    """The shared store of record (e.g. Redis) did not answer: nothing was read, and a write
    that raises it committed nothing. Chats fall back to plain prefill; writes fail."""
