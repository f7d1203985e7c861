"""What the connector counts: injections, fallbacks by reason, store hits and bytes by tier, waits.

Plain counters, vLLM-free. Each side of the connector keeps its own
:class:`ConnectorStats` and hands vLLM what it counted since the last call
(:meth:`ConnectorStats.take`); vLLM sums the workers' and the scheduler's
counts and shows them on ``/metrics`` (:mod:`inferscale.connector.metrics`).
The scheduler side counts requests (injected, or fallen back and why); the
worker side of tensor-parallel rank 0 counts where each load found the user's
K/V (the memory tier, or the disk) and the bytes it read there (rank 0's heads).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping

from inferscale.inject.report import Fallback, client_code

INJECTED_REQUESTS = "injected_requests"
INJECTED_TOKENS = "injected_tokens"
FALLBACK_PREFIX = "fallback."
HIT_PREFIX = "store_hit."
#: bytes of K/V the loads read, by the tier that served them: "store_bytes.<tier>"
BYTES_PREFIX = "store_bytes."
#: seconds of host time the connector spent, by step: "plan" (scheduler: matching a request with
#: memory), "load" (worker: queueing a step's loads), "wait" (worker: the forward stream's waits)
HOST_PREFIX = "host_seconds."
PLAN_CALLS = "plan_calls"
#: worker steps that wrote loads, by how their K/V reached the GPU: "load_steps.<read>" (:data:`STEP_READS`)
STEP_PREFIX = "load_steps."
#: "resident": from the engine's own device memory (the hbm tier, or anything on a CPU); "copied": from
#: pinned host memory, copied to the GPU first; "in_place": pinned host memory read in place by the
#: write; "beside_batch": loads issued beside the batch (Config.tuning.async_loads), copied
STEP_READS = ("resident", "copied", "in_place", "beside_batch")
#: requests whose memory was matched, by the recompute budget they got: "recompute_budget.<tokens>"
BUDGET_PREFIX = "recompute_budget."
#: requests parked while their memory loaded beside the batch, once scheduled
PARKED_REQUESTS = "parked_requests"
#: the schedules they waited, "parked_schedules.<until>" (:data:`PARKED_UNTIL`)
PARKED_PREFIX = "parked_schedules."
#: "reported": built after the parking one before the workers' report was read; "scheduled": from the
#: parking one to the one that ran the request (inject/background_requests.py)
PARKED_UNTIL = ("reported", "scheduled")
#: the seconds they waited, from the schedule that parked them to the one that ran them
PARKED_SECONDS = "parked_seconds"


class ConnectorStats:
    """Thread-safe counters: injected requests/tokens, fallbacks by reason, store hits and bytes
    by tier, host seconds by step."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def record_injection(self, num_tokens: int) -> None:
        self._add({INJECTED_REQUESTS: 1, INJECTED_TOKENS: num_tokens})

    def record_fallback(self, reason: Fallback) -> None:
        """Counted under the coarse code a client is told (:func:`report.client_code`), never the
        precise reason: a forged request must not learn from ``/metrics`` whether a user or a
        fact exists (the reason goes to the server log)."""
        self._add({FALLBACK_PREFIX + client_code(reason): 1})

    def record_hit(self, tier: str, nbytes: int = 0) -> None:
        """A load found the user's K/V in ``tier`` (a store name: "pinned", "hbm", "disk") and read
        ``nbytes`` of K/V there."""
        self._add({HIT_PREFIX + tier: 1, BYTES_PREFIX + tier: nbytes})

    def record_host_time(self, step: str, seconds: float) -> None:
        """``seconds`` of host time in ``step``."""
        self._add({HOST_PREFIX + step: seconds})

    def record_load_step(self, read: str) -> None:
        """A worker step wrote loads whose K/V reached the GPU as ``read`` (one of :data:`STEP_READS`)."""
        self._add({STEP_PREFIX + read: 1})

    def record_plan(self, seconds: float) -> None:
        """The scheduler matched a request with its memory in ``seconds``."""
        self._add({HOST_PREFIX + "plan": seconds, PLAN_CALLS: 1})

    def record_parked(self, until_reported: int, until_scheduled: int, seconds: float) -> None:
        """A request parked for its background load was scheduled, having waited ``until_reported``
        and ``until_scheduled`` schedules and ``seconds``."""
        self._add({PARKED_REQUESTS: 1, PARKED_PREFIX + "reported": until_reported,
                   PARKED_PREFIX + "scheduled": until_scheduled, PARKED_SECONDS: seconds})

    def record_budget(self, tokens: int) -> None:
        """A request whose memory was matched got a recompute budget of ``tokens``."""
        self._add({f"{BUDGET_PREFIX}{tokens}": 1})

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def take(self) -> dict[str, int]:
        """The counts since the last ``take`` (and start again from zero)."""
        with self._lock:
            counts, self.counts = dict(self.counts), Counter()
        return counts

    def _add(self, counts: Mapping[str, int]) -> None:
        with self._lock:
            self.counts.update(counts)


def add_counts(into: dict[str, int], other: Mapping[str, int]) -> dict[str, int]:
    """``into`` plus ``other``, key by key (in place)."""
    for key, value in other.items():
        into[key] = into.get(key, 0) + value
    return into
