"""The product connector, recording which of its writers wrote each load and keeping a handle on
both of its sides (an in-process engine runs them in the test's process)."""

from inferscale.connector import compat
from inferscale.connector.vllm_adapter import InferScaleConnector
from inferscale.inject.background import BackgroundWriter
from inferscale.inject.stats import ConnectorStats
from inferscale.inject.writer import KVWriter

#: ("before" | "background", request ids) for every step a writer was asked to write
WRITES: list[tuple[str, list[str]]] = []
#: the live connector of each side: "scheduler", "worker"
SIDES: dict[str, InferScaleConnector] = {}
#: (schedules until reported, until scheduled, seconds) of every parked request the scheduler side counted
PARKED: list[tuple[int, int, float]] = []


class RecordingStats(ConnectorStats):
    """The scheduler side's counters, keeping each parked request's wait as well (vLLM takes the
    counts every step)."""

    def record_parked(self, until_reported, until_scheduled, seconds):
        PARKED.append((until_reported, until_scheduled, seconds))
        super().record_parked(until_reported, until_scheduled, seconds)


class RecordingWriter(KVWriter):
    def write_step(self, loads, cache, waits_per_layer=True):
        WRITES.append(("before", [spec.req_id for spec in loads]))
        super().write_step(loads, cache, waits_per_layer)


class RecordingBackgroundWriter(BackgroundWriter):
    def _issue(self, loads, cache):
        WRITES.append(("background", [spec.req_id for spec in loads]))
        super()._issue(loads, cache)


class RecordingConnector(InferScaleConnector):
    writer_type = RecordingWriter
    background_writer_type = RecordingBackgroundWriter

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        if role == compat.KVConnectorRole.SCHEDULER:
            self.stats = RecordingStats()
        SIDES["scheduler" if role == compat.KVConnectorRole.SCHEDULER else "worker"] = self
