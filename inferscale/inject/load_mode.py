"""Scheduler side, vLLM-free: whether requests load their memory before the batch or beside it.

A synchronous load (vLLM's ``(n, False)``) is written into the request's blocks before the forward
pass of the step that prefills the request: that step, and every request in it, waits for the
read. A background load (``(n, True)``) lets the batch run on: vLLM allocates the request's
blocks and parks it in ``WAITING_FOR_REMOTE_KVS``, the worker copies the K/V on a stream of its
own (:mod:`~inferscale.inject.background`) and says when it has arrived, and the request joins a
later step with its memory already in place. It costs the request at least one more engine step
(where the read is short, as from GPU memory, that step is all it adds), and spares the others
the read (where it is long, as from host memory over the bus, that is most of a step).

``Config.tuning.async_loads`` chooses: ``"always"``, ``"never"``, or ``"auto"``, which loads in
the background on a GPU whose memory tier does not hold K/V in device memory. The scheduler
side cannot see the worker's tier (which users it holds, and where, lives in the worker
process), so "auto" goes by the tier the config names: ``"hbm"`` is read on the device, in one
kernel, and stays synchronous; ``"pinned"``, ``"disk"`` and any plugin tier cross the bus and
load in the background. On a CPU nothing crosses a bus and a background load would only cost
the request its extra step: "auto" keeps it synchronous there. Nor does "auto" send a request to
the background when it would run alone (no other request decodes, is admitted into the step or
waits: :meth:`~inferscale.inject.load_signal.EngineLoad.alone`): there is no batch to spare, and
the extra steps are all the request would gain (on one H100, k = 50 from host memory, a lone
request's TTFT rose 1.8 ms over the question alone when loaded before the forward pass, 8.5 ms in
the background).

Between the two, ``Config.tuning.before_forward_tokens`` lets "auto" load the first requests of a
step before its forward pass, up to that many memory tokens a step, and only the rest beside the
batch. Their copies run on the copy engines while the GPU still runs the step before (vLLM
schedules a step ahead), so a few cost the batch nothing and spare those requests the steps they
would wait parked; what a step cannot hide is a burst, and the budget sends a burst's excess to the
background. 0 (the default until measured otherwise) loads every request beside the batch that
would not run alone.
"""

from __future__ import annotations

from dataclasses import dataclass

#: memory tiers that hold K/V in the engine's device memory (read by one kernel on the device)
DEVICE_TIERS = frozenset({"hbm"})


@dataclass(frozen=True)
class LoadMode:
    """When the scheduler side sends a request's load to the background: never unless
    ``background``; with ``lone_before_forward`` not a request that would run alone; nor one whose
    load still fits the ``before_forward_tokens`` its step may load before the forward pass."""

    background: bool
    lone_before_forward: bool = False
    before_forward_tokens: int = 0

    def beside_batch(self, alone: bool, tokens: int, step_tokens: int = 0) -> bool:
        """Whether a request's load of ``tokens`` memory tokens goes to the background (``alone``:
        nothing else would run in its step; ``step_tokens``: the memory tokens its step already
        loads before the forward pass)."""
        if not self.background or (alone and self.lone_before_forward):
            return False
        return step_tokens + tokens > self.before_forward_tokens


def load_mode(async_loads: str, kv_store: str, device_type: str, before_forward_tokens: int = 0) -> LoadMode:
    """The :class:`LoadMode` of an engine on ``device_type`` with the memory tier ``kv_store``
    under ``Config.tuning.async_loads`` and ``before_forward_tokens`` (see the module)."""
    if async_loads == "auto":
        return LoadMode(device_type == "cuda" and kv_store not in DEVICE_TIERS, lone_before_forward=True,
                        before_forward_tokens=before_forward_tokens)
    return LoadMode(async_loads == "always")
