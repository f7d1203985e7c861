"""Worker side, vLLM-free: users read from the store of record into the memory tier on threads of
their own (``Config.tuning.user_read_threads``, several users at once), for background loads
(:mod:`~inferscale.inject.background`).

A load written before the forward pass reads a user its memory tier does not hold from disk right
there, on the engine's thread: every request of the step waits for the read (tens of milliseconds
for a large user). A background load need not: its request waits anyway, so its user is read on
this thread (:func:`~inferscale.storage.tiers.fill.ensure_user`, as the synchronous path reads it) and
the load is issued at a later step, once the read is done, while the engine's thread goes on with
the batch. The memory tier is made for this (readers take no lock; writers are serialised by its
own); a user is read by one thread at a time here, and a user read twice at once (here and by the
engine's thread) loads the same version twice, which is harmless.

A read that fails is not reported here: the load is issued when the read is done, whatever its
outcome, and the loader, finding the user still missing, reads it again on the engine's thread,
meets the same failure and reports the load's blocks, with the reason in the log.
"""

from __future__ import annotations

import concurrent.futures

from inferscale.compose.segment import SYSTEM_USER
from inferscale.inject.loader import LoadSpec
from inferscale.storage.tiers.fill import ensure_user
from inferscale.storage.tiers import Tiers


class UserFills:
    def __init__(self, tiers: Tiers, threads: int):
        self.tiers, self.threads = tiers, threads
        self._reads: dict[str, concurrent.futures.Future] = {}  # by user, under way (or just done)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # started on first use

    def reads(self, spec: LoadSpec) -> list[concurrent.futures.Future]:
        """The reads ``spec`` waits for: of its users (the instruction prefix's and the request's)
        that the memory tier does not hold in the epochs the request was scheduled with, started
        here unless one is under way. Empty: issue it now."""
        self._reads = {user_id: read for user_id, read in self._reads.items() if not read.done()}
        waits = []
        for user_id, epoch in zip((SYSTEM_USER, spec.user_id), spec.epochs):
            if self._missing(user_id, epoch):
                if user_id not in self._reads:
                    self._reads[user_id] = self._start(user_id)
                waits.append(self._reads[user_id])
        return waits

    def close(self) -> None:
        """Wait for the reads under way, and stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._reads.clear()

    def _missing(self, user_id: str, epoch: str) -> bool:
        memory = self.tiers.memory
        return bool(memory.volatile) and memory.epoch(user_id) != epoch

    def _start(self, user_id: str) -> concurrent.futures.Future:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="inferscale-user-fill")
        return self._pool.submit(ensure_user, self.tiers.memory, self.tiers.record, user_id)
