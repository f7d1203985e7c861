"""Whether the engine has room to prefill a request's recompute tail: the scheduler side's view of load.

An adaptive recompute budget (:data:`~inferscale.compose.blend.ADAPTIVE`) is spent only while the
engine has prefill capacity to spare. A lone request's tail of a few hundred tokens costs a GPU
about nothing (a step that small is bound by reading the weights, not by compute); under load
every token of a step costs its full price and delays every request decoding in the same step
(at 100 users on an H100, about 18 µs of GPU time per recomputed token and request).

The connector's scheduler side sees each request arrive (``on_new_request``), get admitted into a
step (``update_state_after_alloc``), each step's scheduled requests (``build_connector_meta``) and
each request finish (``request_finished``). :class:`EngineLoad` keeps from these what the step
being scheduled holds:

* the requests waiting to be admitted (arrived, neither admitted nor finished);
* the requests decoding: those scheduled in the last step and not finished since, one token each;
* the tokens of the requests admitted so far in this step (their prompt less what is injected),
  those vLLM parks to load their memory in the background included: they join the batch a step
  or two later, prefilling as much, and a burst of them is load as much as a burst scheduled at
  once;
* the memory tokens those admitted requests load before the step's forward pass
  (:meth:`EngineLoad.loaded_before_forward`: the budget ``Config.tuning.before_forward_tokens`` of
  :mod:`~inferscale.inject.load_mode` is spent against it).

A request has room (:meth:`EngineLoad.has_room`) while at most ``max_waiting`` other requests wait
and the step holds at most ``max_step_tokens`` tokens of other requests' work. Its own question
does not count: however long, it costs the others nothing more with a tail than without, and a
lone request always has room. vLLM's own
token budget (``max_num_batched_tokens``) is no such signal: it is sized to keep chunked prefill
fair (8,192 tokens for ``vllm serve`` on an H100), far past the few hundred tokens where a step
stops being free; at 100 users a step holds about 200 tokens, and every recomputed token there
already cost its full price.

:meth:`EngineLoad.has_room` only reads: vLLM may ask about a request twice, and the answer changes
only when a request arrives, is admitted or finishes, or a step is built, never between vLLM's
question about a request and its admission.
"""

from __future__ import annotations

from collections.abc import Iterable


class EngineLoad:
    """The load of the step being scheduled, as the scheduler side of the connector sees it."""

    def __init__(self, max_step_tokens: int, max_waiting: int):
        self.max_step_tokens = max_step_tokens
        self.max_waiting = max_waiting
        self._waiting: set[str] = set()
        self._decoding: set[str] = set()
        # admitted in this step: request id → (tokens it prefills, memory tokens loaded before the forward pass)
        self._admitted: dict[str, tuple[int, int]] = {}

    def arrived(self, req_id: str) -> None:
        self._waiting.add(req_id)

    def admitted(self, req_id: str, tokens: int, loaded: int = 0) -> None:
        """``req_id`` is scheduled in this step, prefilling ``tokens`` tokens, its memory's
        ``loaded`` tokens written before the forward pass."""
        self._waiting.discard(req_id)
        self._decoding.discard(req_id)
        self._admitted[req_id] = (max(0, tokens), max(0, loaded))

    def step_built(self, scheduled: Iterable[str]) -> None:
        """The step is complete: the requests it scheduled decode in the next one."""
        self._decoding = set(scheduled)
        self._admitted.clear()

    def finished(self, req_id: str) -> None:
        self._waiting.discard(req_id)
        self._decoding.discard(req_id)
        self._admitted.pop(req_id, None)

    def loaded_before_forward(self, besides: str | None = None) -> int:
        """Memory tokens the step being scheduled loads before its forward pass so far (``besides``'
        own left out)."""
        return sum(loaded for req_id, (_, loaded) in self._admitted.items() if req_id != besides)

    def step_tokens(self, besides: str | None = None) -> int:
        """Tokens the step being scheduled holds so far (``besides``' own left out)."""
        return (len(self._decoding) - (besides in self._decoding)
                + sum(tokens for req_id, (tokens, _) in self._admitted.items() if req_id != besides))

    def waiting_besides(self, req_id: str) -> int:
        """Requests waiting to be admitted, ``req_id`` left out."""
        return len(self._waiting) - (req_id in self._waiting)

    def alone(self, req_id: str) -> bool:
        """Whether ``req_id`` would run alone in the step being scheduled: no other request decodes,
        is admitted into it with tokens to prefill (one parked to load in the background included) or
        waits."""
        return self.step_tokens(besides=req_id) == 0 and self.waiting_besides(req_id) == 0

    def has_room(self, req_id: str) -> bool:
        """Whether ``req_id`` may have its tail prefilled in the step being scheduled."""
        return self.waiting_besides(req_id) <= self.max_waiting and self.step_tokens() <= self.max_step_tokens

    @classmethod
    def from_tuning(cls, tuning) -> EngineLoad:
        """The thresholds of a :class:`~inferscale.config.tuning.Tuning`."""
        return cls(tuning.tail_max_step_tokens, tuning.tail_max_waiting)
