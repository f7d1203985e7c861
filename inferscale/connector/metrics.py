"""The connector's counts on vLLM's ``/metrics``, through vLLM's KV-connector stats.

vLLM asks each side of the connector for its stats every step
(``get_kv_connector_stats``), sums them across workers and the scheduler
(:meth:`InferScaleStats.aggregate`), sends the sum to the API server process,
and there hands it to the metrics the connector class registered
(``build_prom_metrics`` → :class:`InferScalePromMetrics`). Counters:

- ``vllm:inferscale_injected_requests_total`` and ``vllm:inferscale_injected_tokens_total``
- ``vllm:inferscale_fallbacks_total{reason}``, by the coarse code a client is told
  (:data:`~inferscale.inject.report.CLIENT_CODES`: ``invalid_params``, ``refused``,
  ``load_error``); the precise reason goes to the server log only
- ``vllm:inferscale_store_hits_total{tier}`` (where a load found the user's K/V)
- ``vllm:inferscale_store_bytes_total{tier}`` (the bytes of K/V those loads read there: from a
  memory tier the tokens the load wrote, of tensor-parallel rank 0's heads; from the store of
  record the whole user, read into the memory tier)
- ``vllm:inferscale_host_seconds_total{step}`` (host time on the request path: ``plan`` on the
  scheduler, ``load`` and ``wait`` on the worker; divided by ``plan_calls`` or
  ``injected_requests``, the mean per call or per request)
- ``vllm:inferscale_plan_calls_total`` (the scheduler's matches of a request with memory)
- ``vllm:inferscale_load_steps_total{read}`` (worker steps that wrote loads, by how the K/V reached
  the GPU: ``resident``, ``copied``, ``in_place``, ``beside_batch``, each shown from 0;
  :data:`~inferscale.inject.stats.STEP_READS`)
- ``vllm:inferscale_parked_requests_total``, ``vllm:inferscale_parked_schedules_total{until}`` and
  ``vllm:inferscale_parked_seconds_total`` (requests parked in ``WAITING_FOR_REMOTE_KVS`` while
  their memory loaded beside the batch, once scheduled: the schedules they waited until the workers'
  report was read, ``reported``, and until they ran, ``scheduled``, and the seconds; divided by the
  requests, the mean wait: :mod:`~inferscale.inject.background_requests`)

and a histogram, ``vllm:inferscale_recompute_budget_tokens`` (the recompute budget each request
whose memory was matched got: with ``recompute_tokens = "adaptive"`` the cap while the engine had
room, 0 when it was busy; :data:`BUDGET_BUCKETS`), each labelled, like vLLM's own, with
``model_name`` and ``engine``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inferscale.connector import compat
from inferscale.inject.stats import (
    BUDGET_PREFIX,
    BYTES_PREFIX,
    FALLBACK_PREFIX,
    HIT_PREFIX,
    HOST_PREFIX,
    INJECTED_REQUESTS,
    INJECTED_TOKENS,
    PARKED_PREFIX,
    PARKED_REQUESTS,
    PARKED_SECONDS,
    PARKED_UNTIL,
    PLAN_CALLS,
    STEP_PREFIX,
    STEP_READS,
    add_counts,
)
from inferscale.inject.report import CLIENT_CODES

#: upper bounds of the recompute budget histogram's buckets (tokens; 0 is a bucket of its own)
BUDGET_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024)


@dataclass
class InferScaleStats(compat.KVConnectorStats):
    """Counts and seconds (``data``: name → number) of one interval; sums when aggregated."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: compat.KVConnectorStats) -> InferScaleStats:
        add_counts(self.data, other.data or {})
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def stats_or_none(counts: dict[str, int]) -> InferScaleStats | None:
    """What ``get_kv_connector_stats`` returns: None when nothing was counted."""
    return InferScaleStats(data=counts) if any(counts.values()) else None


class InferScalePromMetrics(compat.KVConnectorPromMetrics):
    """Prometheus counters for the connector's counts, one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.requests = self._counter("injected_requests", "Requests whose memory was injected as K/V.")
        self.tokens = self._counter("injected_tokens", "Memory tokens injected as K/V instead of prefilled.")
        self.fallbacks = self._counter("fallbacks", "Requests whose memory was prefilled normally, by the coarse "
                                       "code their report carries.", "reason")
        self.hits = self._counter("store_hits", "Loads of a user's K/V, by the store tier that held it.", "tier")
        self.bytes = self._counter("store_bytes", "Bytes of K/V the loads read, by the store tier that held them.",
                                   "tier")
        self.host = self._counter("host_seconds", "Host time the connector spent on the request path, by step.",
                                  "step")
        self.plans = self._counter("plan_calls", "Times the scheduler matched a request against its memory.")
        self.steps = self._counter("load_steps", "Worker steps that wrote loads, by how their K/V reached the GPU.",
                                   "read")
        self.parked = self._counter("parked_requests", "Requests parked while their memory loaded beside the "
                                    "batch, counted when scheduled.")
        self.parked_schedules = self._counter("parked_schedules", "Schedules the parked requests waited: until "
                                              "the workers' report was read, and until they ran.", "until")
        self.parked_seconds = self._counter("parked_seconds", "Seconds the parked requests waited, from the "
                                            "schedule that parked them to the one that ran them.")
        self.budgets = self._histogram("recompute_budget_tokens", "Recompute budget (memory tokens left to vLLM "
                                       "at most) of each request whose memory was matched.", BUDGET_BUCKETS)
        for engine in self.per_engine_labelvalues:
            for code in CLIENT_CODES:  # every code shows, at 0 until it happens
                self.fallbacks(engine, code)
            for read in STEP_READS:  # every read path too: a 0 says the path was not taken
                self.steps(engine, read)
            self.parked(engine)  # at 0 until a request is parked
            self.parked_seconds(engine)
            for until in PARKED_UNTIL:
                self.parked_schedules(engine, until)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if not value:
                continue
            if key == INJECTED_REQUESTS:
                self.requests(engine_idx).inc(value)
            elif key == INJECTED_TOKENS:
                self.tokens(engine_idx).inc(value)
            elif key.startswith(FALLBACK_PREFIX):
                self.fallbacks(engine_idx, key.removeprefix(FALLBACK_PREFIX)).inc(value)
            elif key.startswith(HIT_PREFIX):
                self.hits(engine_idx, key.removeprefix(HIT_PREFIX)).inc(value)
            elif key.startswith(BYTES_PREFIX):
                self.bytes(engine_idx, key.removeprefix(BYTES_PREFIX)).inc(value)
            elif key.startswith(HOST_PREFIX):
                self.host(engine_idx, key.removeprefix(HOST_PREFIX)).inc(value)
            elif key == PLAN_CALLS:
                self.plans(engine_idx).inc(value)
            elif key.startswith(STEP_PREFIX):
                self.steps(engine_idx, key.removeprefix(STEP_PREFIX)).inc(value)
            elif key == PARKED_REQUESTS:
                self.parked(engine_idx).inc(value)
            elif key.startswith(PARKED_PREFIX):
                self.parked_schedules(engine_idx, key.removeprefix(PARKED_PREFIX)).inc(value)
            elif key == PARKED_SECONDS:
                self.parked_seconds(engine_idx).inc(value)
            elif key.startswith(BUDGET_PREFIX):
                self._observe_budget(engine_idx, int(key.removeprefix(BUDGET_PREFIX)), int(value))

    def _observe_budget(self, engine: int, tokens: int, requests: int) -> None:
        histogram = self.budgets(engine)
        for _ in range(requests):
            histogram.observe(tokens)

    def _counter(self, name: str, documentation: str, extra_label: str | None = None):
        """A counter ``vllm:inferscale_<name>``; returns ``child(engine[, label value])``."""
        extra = [extra_label] if extra_label else []
        counter = self._counter_cls(name=f"vllm:inferscale_{name}", documentation=documentation,
                                    labelnames=[*self._labelnames, *extra])

        def child(engine: int, *values: str):
            return counter.labels(*self.per_engine_labelvalues[engine], *values)

        return child

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]):
        """A histogram ``vllm:inferscale_<name>``; returns ``child(engine)``."""
        histogram = self._histogram_cls(name=f"vllm:inferscale_{name}", documentation=documentation,
                                        buckets=list(buckets), labelnames=self._labelnames)
        return lambda engine: histogram.labels(*self.per_engine_labelvalues[engine])
