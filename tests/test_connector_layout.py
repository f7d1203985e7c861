"""A KV cache layout the connector cannot read gets no memory written into it: the engine
starts, says so in one log line, and serves every request by plain prefill."""

from __future__ import annotations

import logging

import pytest

import tiny_models
import vllm_harness as vh

pytestmark = pytest.mark.slow

FACTS = ["Alice has a cat named Miso.", "Alice works as a nurse in Lisbon."]


def test_an_unreadable_cache_layout_is_never_written_and_requests_are_prefilled(tmp_path, capfd):
    from plugins import layout_connectors

    path = tiny_models.tiny_model_dir("qwen2", "float32")
    prompt, segment = vh.joint_memory(path, tmp_path, "alice", FACTS, "What is my cat called?")
    layout_connectors.WRITES.clear()
    capfd.readouterr()
    # the line is read both from the connector's logger and from the output: which of the two
    # sees it depends on how an earlier engine in this process left vLLM's log handlers
    records = _Records()
    connector_log = logging.getLogger("vllm.inferscale.connector")
    connector_log.addHandler(records)
    try:
        llm = vh.make_engine(path, tmp_path, "float32", connector=("UnreadableLayoutConnector", "plugins.layout_connectors"))
    finally:
        connector_log.removeHandler(records)
    try:
        started = capfd.readouterr()
        printed = [line for line in (started.out + started.err).splitlines() if "memory injection is off" in line]
        logged = [line for line in records.lines if "memory injection is off" in line]
        off = logged or printed
        assert len(off) == 1 and "fits no known arrangement" in off[0], (logged, printed)
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
