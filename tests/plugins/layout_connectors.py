"""Connectors that register vLLM's caches in a layout the product cannot read."""

from inferscale.connector.vllm_adapter import InferScaleConnector
from inferscale.inject.writer import KVWriter

#: every step the worker was asked to write (there must be none)
WRITES: list = []


class RecordingWriter(KVWriter):
    def write_step(self, loads, cache, waits_per_layer=True):
        WRITES.append([spec.req_id for spec in loads])
        super().write_step(loads, cache, waits_per_layer)


class UnreadableLayoutConnector(InferScaleConnector):
    """Hands the product each layer's cache with its heads and slots dims swapped: a tensor of
    an unexpected shape and stride order, as a new backend might register."""

    writer_type = RecordingWriter

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches({name: cache.transpose(1, 2) for name, cache in kv_caches.items()})
