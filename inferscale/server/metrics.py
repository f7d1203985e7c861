"""The front's own Prometheus metrics; ``/metrics`` shows them and the engine's.

Front (this process): retrieval and compose latency per chat request, chat
requests by memory mode, memory operations by kind (count and latency), and
errors answered by status. Engine (vLLM's ``/metrics``, fetched on loopback
and appended): vLLM's own metrics and the connector's counts, e.g.
``vllm:inferscale_fallbacks_total{reason}`` (:mod:`inferscale.connector.metrics`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
SLOW_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class FrontMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.retrieval = Histogram("inferscale_retrieval_seconds", "Embedding the query and searching the "
                                   "user's facts, per chat request.", buckets=FAST_BUCKETS, registry=self.registry)
        self.compose = Histogram("inferscale_compose_seconds", "Laying out memory and conversation as token ids "
                                 "(with the salt), per chat request.", buckets=FAST_BUCKETS, registry=self.registry)
        self.chats = Counter("inferscale_chat_requests", "Chat requests, by memory mode (kv, prompt, none).",
                             ["mode"], registry=self.registry)
        self.memory = Histogram("inferscale_memory_operation_seconds", "Memory operations (add, list, search, "
                                "update, delete, forget), by kind.", ["operation"], buckets=SLOW_BUCKETS,
                                registry=self.registry)
        self.engine_retries = Counter("inferscale_engine_retries", "Requests sent to the engine again because no "
                                      "replica answered (inferscale serve --engine-url).", registry=self.registry)
        self.errors = Counter("inferscale_errors", "Requests answered with an error, by HTTP status.", ["status"],
                              registry=self.registry)

    @contextmanager
    def timed(self, histogram) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            histogram.observe(time.perf_counter() - start)

    def render(self) -> bytes:
        return generate_latest(self.registry)
