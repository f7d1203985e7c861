"""The facade end to end on a tiny model: build memory, answer with KV injection,
with prompt injection and without memory; memory survives a restart."""

from __future__ import annotations

import math

import pytest

import tiny_models
import vllm_harness
from inferscale import UnknownUserError
from inferscale.api import InferScale
from inferscale.demo_data import FACTS, TURNS, USER

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mem(tmp_path_factory):
    model = tiny_models.tiny_model_dir("qwen2", "float32")
    data = tmp_path_factory.mktemp("api")
    api = InferScale.from_config({"model": str(model), "data_dir": str(data)}, enforce_eager=True,
                                 kv_cache_memory_bytes=128 << 20, max_model_len=1024)
    api.add_conversation(USER, TURNS, FACTS, progress=False)
    with vllm_harness.env(VLLM_ENABLE_V1_MULTIPROCESSING="0"):  # the engine starts lazily, in-process
        yield api
    api.close()
    vllm_harness.close_engine_state()


def test_kv_injection_prefills_only_the_question(mem):
    answer = mem.generate(USER, "What is the name of my cat?", k=5, max_tokens=4)
    assert answer.fallback is None
    assert len(answer.fact_ids) == 5
    # the CPU default recomputes at most 16 tokens of whole facts at the tail; the rest is injected
    assert answer.injected_tokens + answer.recomputed_tokens == answer.memory_tokens
    assert answer.injected_tokens > 0 and 0 <= answer.recomputed_tokens <= 16
    assert answer.prompt_tokens > answer.memory_tokens
    assert {"retrieval", "compose", "engine_ttft", "total", "query_to_first_token"} <= set(answer.timings)
    assert not math.isnan(answer.timings["engine_ttft"])


def test_prompt_injection_uses_the_same_tokens(mem):
    kv = mem.generate(USER, "Where does my sister live?", k=4, max_tokens=4)
    text = mem.generate(USER, "Where does my sister live?", k=4, mode="prompt", max_tokens=4)
    assert text.fact_ids == kv.fact_ids and text.prompt_tokens == kv.prompt_tokens
    assert text.injected_tokens == 0 and text.fallback is None
    none = mem.generate(USER, "Where does my sister live?", mode="none", max_tokens=4)
    assert none.fact_ids == [] and none.memory_tokens == 0


def test_recompute_budget_per_request(mem):
    question = "What am I allergic to?"
    injected = mem.generate(USER, question, k=4, max_tokens=6, recompute_tokens=0)
    assert injected.injected_tokens == injected.memory_tokens and injected.recomputed_tokens == 0
    everything = mem.generate(USER, question, k=4, max_tokens=6, recompute_tokens=10_000)
    text = mem.generate(USER, question, k=4, max_tokens=6, mode="prompt")
    assert everything.recomputed_tokens == everything.memory_tokens - len(mem.prefix_ids)
    assert everything.injected_tokens in (0, len(mem.prefix_ids))  # the prefix may already be in vLLM's cache
    assert everything.text == text.text  # only the exact prefix reused: prompt injection's answer


def test_at_most_five_facts_per_turn(mem):
    facts = [(f"Fact number {i} about the weather.", "D1:2") for i in range(8)]
    stored = mem.add_conversation("lee", TURNS, facts, progress=False)
    assert len(stored) == 5


def test_unknown_user_is_a_clear_error(mem):
    with pytest.raises(UnknownUserError, match="nobody"):
        mem.generate("nobody", "Hi?")


def test_memory_survives_a_restart(mem):
    again = InferScale(mem.config)
    assert again.retriever.count(USER) == len(FACTS)
    hits = again.retrieve(USER, "What is the name of my cat?", k=3)
    assert hits == mem.retrieve(USER, "What is the name of my cat?", k=3)
