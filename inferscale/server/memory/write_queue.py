"""Memory writes, fairly: one at a time on the encoder, in arrival order, a large add in chunks.

One encoder and one Mem0 store serve every writer, so writes take turns
(:class:`FairLock`: first come, first served, unlike a plain lock, which a thread
that just let go may take again at once). A large add takes a turn per chunk
(:func:`chunks`, at most :data:`CHUNK_CHARS` characters of facts), so another
user's small write waits for one chunk, a few seconds, never for the whole add;
one user's writes stay in their order (:class:`UserLocks`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

#: characters of facts encoded in one turn of the encoder (a few seconds on a CPU for a 0.5B model)
CHUNK_CHARS = 4_000


class FairLock:
    """A lock handed over in the order it was asked for."""

    def __init__(self):
        self._turns = threading.Condition()
        self._next = self._serving = 0

    def __enter__(self) -> FairLock:
        with self._turns:
            ticket, self._next = self._next, self._next + 1
            while ticket != self._serving:
                self._turns.wait()
        return self

    def __exit__(self, *exc) -> None:
        with self._turns:
            self._serving += 1
            self._turns.notify_all()


class UserLocks:
    """One lock per user with a write under way (and none kept for users without one)."""

    def __init__(self):
        self._guard = threading.Lock()
        self._held: dict[str, tuple[threading.Lock, int]] = {}

    @contextlib.contextmanager
    def hold(self, user_id: str) -> Iterator[None]:
        with self._guard:
            lock, users = self._held.get(user_id, (threading.Lock(), 0))
            self._held[user_id] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._held[user_id]
                if users == 1:
                    del self._held[user_id]
                else:
                    self._held[user_id] = (lock, users - 1)


def chunks(facts: Sequence[tuple[str, str | None]], max_chars: int = CHUNK_CHARS) -> Iterator[list]:
    """``facts`` in order, in runs of at most ``max_chars`` characters (a longer fact alone)."""
    run: list = []
    size = 0
    for fact in facts:
        if run and size + len(fact[0]) > max_chars:
            yield run
            run, size = [], 0
        run.append(fact)
        size += len(fact[0])
    if run:
        yield run
