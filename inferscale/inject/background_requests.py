"""Scheduler side, vLLM-free: the requests whose memory loads in the background, from the blocks
vLLM allocates them to the worker's word that the load has arrived.

vLLM asks for a request's blocks (``update_state_after_alloc``) in the step that parks it in
``WAITING_FOR_REMOTE_KVS``, and that request is not among the step's scheduled ones: its
blocks are known only then, and its load goes to the workers with that same step's metadata
(:meth:`BackgroundRequests.to_send`). From then on the request is *loading* until the workers
report it (``finished_recving``, :meth:`BackgroundRequests.arrived`). A request that finishes
while it loads was aborted: vLLM keeps its blocks until the load is reported, and its memory
counts as injected nowhere (:meth:`BackgroundRequests.finished`).
"""

from __future__ import annotations

from collections.abc import Iterable

from inferscale.inject.planner import Plan


class BackgroundRequests:
    def __init__(self):
        self._allocated: dict[str, tuple[Plan, list[int]]] = {}  # blocks allocated, load not sent yet
        self._loading: set[str] = set()  # load sent, not reported back yet

    def allocated(self, req_id: str, plan: Plan, block_ids: list[int]) -> None:
        """vLLM allocated ``block_ids`` (all the request's blocks, in order) for ``plan``'s load."""
        self._allocated[req_id] = (plan, list(block_ids))

    def to_send(self) -> list[tuple[str, Plan, list[int]]]:
        """The loads to send with this step's metadata; their requests are loading from now on."""
        loads = [(req_id, plan, blocks) for req_id, (plan, blocks) in self._allocated.items()]
        self._loading.update(self._allocated)
        self._allocated.clear()
        return loads

    def arrived(self, req_ids: Iterable[str]) -> None:
        """The workers reported these requests' loads (arrived, or failed)."""
        self._loading.difference_update(req_ids)

    def finished(self, req_id: str) -> bool:
        """Forget the request (vLLM finished it); True when its load was still in flight."""
        self._allocated.pop(req_id, None)
        loading = req_id in self._loading
        self._loading.discard(req_id)
        return loading

    def is_loading(self, req_id: str) -> bool:
        return req_id in self._loading

    def __len__(self) -> int:
        """Requests allocated or loading (0 once every one has been reported or finished)."""
        return len(self._allocated) + len(self._loading)
