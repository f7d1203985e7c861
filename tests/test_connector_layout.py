"""A KV cache layout the connector cannot read gets no memory written into it: the engine
starts, says so in one log line, and serves every request by plain prefill."""

from __future__ import annotations

import logging

import pytest

import tiny_models
import vllm_harness as vh

pytestmark = pytest.mark.slow

FACTS = ["Alice has a cat named Miso.", "Alice works as a nurse in Lisbon."]


def test_an_unreadable_cache_layout_is_never_written_and_requests_are_prefilled(tmp_path):
    from plugins import layout_connectors

    path = tiny_models.tiny_model_dir("qwen2", "float32")
    prompt, segment = vh.joint_memory(path, tmp_path, "alice", FACTS, "What is my cat called?")
    layout_connectors.WRITES.clear()
    # read from the connector's logger through a filter: vLLM's start re-applies its dictConfig,
    # which drops the handlers of every logger under "vllm" (filters stay), and the printed line
    # can escape capfd where an earlier engine in this process left its handlers
    records = _Records()
    connector_log = logging.getLogger("vllm.inferscale.connector")
    connector_log.addFilter(records)
    try:
        # eager: what is checked is the start and the fallback, not graph capture (on the H200, a
        # float32 engine capturing after earlier CUDA-graph engines of the process tripped torch's
        # graph-pool assert "it->second->use_count > 0", CUDACachingAllocator.cpp:2799)
        llm = vh.make_engine(path, tmp_path, "float32", enforce_eager=True,
                             connector=("UnreadableLayoutConnector", "plugins.layout_connectors"))
    finally:
        connector_log.removeFilter(records)
    try:
        off = [line for line in records.lines if "memory injection is off" in line]
        assert len(off) == 1 and "fits no known arrangement" in off[0], records.lines
        plain_tokens, _, plain = vh.greedy(llm, prompt)
        params, salt = vh.memory_request(tmp_path, "alice", ["f0", "f1"], segment)
        tokens, _, out = vh.greedy(llm, prompt, params, salt)
        assert vh.report(out) == {"injected_tokens": 0, "recomputed_tokens": 0, "recompute_budget": 0,
                                  "engine_busy": None, "fallback": "load_error"}
        assert out.num_cached_tokens == 0  # nothing claimed: vLLM prefilled the whole prompt
        assert tokens == plain_tokens and vh.logprob_gap(out, plain)[0] == 0.0
        assert layout_connectors.WRITES == [], "K/V were written into a layout not understood"
    finally:
        vh.close_engine(llm)


class _Records(logging.Filter):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.lines.append(record.getMessage())
        return True
