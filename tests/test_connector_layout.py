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
    # read from the connector's logger: vLLM's start reconfigures its own handlers, and where an
    # earlier engine in this process left them, the printed line can escape capfd
    records = _Records()
    connector_log = logging.getLogger("vllm.inferscale.connector")
    connector_log.addHandler(records)
    try:
        llm = vh.make_engine(path, tmp_path, "float32", connector=("UnreadableLayoutConnector", "plugins.layout_connectors"))
    finally:
        connector_log.removeHandler(records)
    try:
        off = [line for line in records.lines if "memory injection is off" in line]
        assert len(off) == 1 and "fits no known arrangement" in off[0], records.lines
        plain_tokens, _, plain = vh.greedy(llm, prompt)
        params, salt = vh.memory_request(tmp_path, "alice", ["f0", "f1"], segment)
        tokens, _, out = vh.greedy(llm, prompt, params, salt)
        assert vh.report(out) == {"injected_tokens": 0, "recomputed_tokens": 0, "fallback": "load_error"}
        assert out.num_cached_tokens == 0  # nothing claimed: vLLM prefilled the whole prompt
        assert tokens == plain_tokens and vh.logprob_gap(out, plain)[0] == 0.0
        assert layout_connectors.WRITES == [], "K/V were written into a layout not understood"
    finally:
        vh.close_engine(llm)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
