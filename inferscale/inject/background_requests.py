"""Scheduler side, vLLM-free: the requests whose memory loads in the background, from the blocks
vLLM allocates them to the worker's word that the load has arrived.

vLLM asks for a request's blocks (``update_state_after_alloc``) in the step that parks it in
``WAITING_FOR_REMOTE_KVS``, and that request is not among the step's scheduled ones: its
blocks are known only then, and its load goes to the workers with that same step's metadata
(:meth:`BackgroundRequests.to_send`). From then on the request is *loading* until the workers
report it (``finished_recving``, :meth:`BackgroundRequests.arrived`). A request that finishes
while it loads was aborted: vLLM keeps its blocks until the load is reported, and its memory
counts as injected nowhere (:meth:`BackgroundRequests.finished`).

**What a parked request waits for.** The book counts the schedules vLLM builds
(:meth:`BackgroundRequests.step_built`), so that when a parked request is at last scheduled
(:meth:`BackgroundRequests.scheduled`) it can say how long it waited, as a :class:`Parked`: the
schedules built after the one that parked it before the workers' report reached the scheduler
(0 where vLLM processes a step's output before it builds the next one; 1 with its asynchronous
scheduling, which builds step N+1 before it reads step N's output), the schedules from the one that
parked it to the one that runs it (at least 1 more than that), and the seconds between the two.
Where those are larger than the protocol's floor, the load itself, not vLLM, kept the request out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from inferscale.inject.planner import Plan


@dataclass(frozen=True)
class Parked:
    """How long one request waited in ``WAITING_FOR_REMOTE_KVS`` (see the module)."""

    until_reported: int  # schedules built after the parking one before the report was read
    until_scheduled: int  # schedules from the parking one to the one that runs the request
    seconds: float  # between the two


class BackgroundRequests:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._allocated: dict[str, tuple[Plan, list[int]]] = {}  # blocks allocated, load not sent yet
        self._loading: set[str] = set()  # load sent, not reported back yet
        self._steps = 0  # schedules built so far
        self._sent: dict[str, tuple[int, float]] = {}  # parked requests: the schedule that sent the load, when
        self._reported: dict[str, int] = {}  # reported, not scheduled yet: schedules built until the report

    def allocated(self, req_id: str, plan: Plan, block_ids: list[int]) -> None:
        """vLLM allocated ``block_ids`` (all the request's blocks, in order) for ``plan``'s load."""
        self._allocated[req_id] = (plan, list(block_ids))

    def to_send(self) -> list[tuple[str, Plan, list[int]]]:
        """The loads to send with this step's metadata; their requests are loading from now on."""
        loads = [(req_id, plan, blocks) for req_id, (plan, blocks) in self._allocated.items()]
        now = self._clock()
        for req_id in self._allocated:
            self._sent[req_id] = (self._steps, now)
        self._loading.update(self._allocated)
        self._allocated.clear()
        return loads

    def arrived(self, req_ids: Iterable[str]) -> None:
        """The workers reported these requests' loads (arrived, or failed)."""
        for req_id in req_ids:
            if req_id in self._loading:  # (sent: its wait is being timed)
                self._reported[req_id] = self._steps - self._sent[req_id][0] - 1
            self._loading.discard(req_id)

    def scheduled(self, req_ids: Iterable[str]) -> list[Parked]:
        """The waits of the parked requests among ``req_ids``, scheduled in the step being built
        (call before :meth:`step_built`); other requests are ignored."""
        waits = []
        for req_id in req_ids:
            if req_id in self._reported:
                step, began = self._sent.pop(req_id)
                waits.append(Parked(self._reported.pop(req_id), self._steps - step, self._clock() - began))
        return waits

    def step_built(self) -> None:
        """vLLM built one more schedule (after its loads were sent: :meth:`to_send`)."""
        self._steps += 1

    def finished(self, req_id: str) -> bool:
        """Forget the request (vLLM finished it); True when its load was still in flight."""
        self._allocated.pop(req_id, None)
        self._sent.pop(req_id, None)
        self._reported.pop(req_id, None)
        loading = req_id in self._loading
        self._loading.discard(req_id)
        return loading

    def is_loading(self, req_id: str) -> bool:
        return req_id in self._loading

    def __len__(self) -> int:
        """Requests allocated or loading (0 once every one has been reported or finished)."""
        return len(self._allocated) + len(self._loading)

    def waits_kept(self) -> int:
        """Parked requests whose wait is still being timed (0 once every one has been scheduled or
        finished)."""
        return len(self._sent)
