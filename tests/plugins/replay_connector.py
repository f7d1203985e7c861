"""The strict control: re-inject the K/V vLLM itself computed for the segment.

Same scheduler side, metadata, slot mapping, stream handling and write op as
the product connector; only the source of the K/V differs: the post-RoPE K/V
recorded by :mod:`vllm_probe` from a plain prefill, written back unchanged. If
the write path is right this must reproduce plain prefill bit for bit.
"""

import torch

import vllm_probe
from inferscale.compose.segment import Segment
from inferscale.connector.vllm_adapter import InferScaleConnector
from inferscale.inject.background import BackgroundWriter
from inferscale.inject.writer import KVWriter


class Replay:
    """The writers' source of K/V, replaced (before the forward pass and in the background alike)."""

    def _fused_views(self, cache):
        return None  # the replay goes through the per-layer write, whose source it replaces

    def _segment(self, spec) -> Segment:
        writes = [vllm_probe.first_write(index) for index in range(self.num_layers)]
        keys = torch.stack([key[spec.start:spec.end] for key, _ in writes])
        values = torch.stack([value[spec.start:spec.end] for _, value in writes])
        return Segment([], spec.start, [], keys, values)


class ReplayWriter(Replay, KVWriter):
    pass


class ReplayBackgroundWriter(Replay, BackgroundWriter):
    pass


class ReplayConnector(InferScaleConnector):
    writer_type = ReplayWriter
    background_writer_type = ReplayBackgroundWriter
