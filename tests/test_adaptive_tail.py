"""The adaptive recompute tail on a real vLLM engine (CPU): a lone request gets its tail, a burst of
queued requests gets its whole memory injected, and each request's report says which."""

from __future__ import annotations

import pytest

import tiny_models
import vllm_harness as vh
from inferscale.compose.blend import AUTO_RECOMPUTE_TOKENS

pytestmark = pytest.mark.slow

#: the last fact (8 tokens) fits the CPU's cap of 16, the two before it do not
FACTS = ["Alice has a cat named Miso.", "Alice works as a nurse in Lisbon.", "Ana is nine."]
QUERY = "What is the name of my cat?"
BURST = 24


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """An engine with the default adaptive tail, Alice's memory, and the prompt that reads it."""
    model = tiny_models.tiny_model_dir("llama", "float32")
    data = tmp_path_factory.mktemp("adaptive")
    prompt, segment = vh.joint_memory(model, data, "alice", FACTS, QUERY)
    llm = vh.make_engine(model, data, "float32", recompute_tokens="adaptive")
    yield llm, data, prompt, segment
    vh.close_engine(llm)


FACT_IDS = [f"f{i}" for i in range(len(FACTS))]


def _generate(llm, prompt, params, salts: list[str]) -> list[dict]:
    """One request per salt, all queued at once; each one's report."""
    from vllm import SamplingParams

    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                              extra_args={"kv_transfer_params": params})
    prompts = [{"prompt_token_ids": list(prompt), "cache_salt": salt} for salt in salts]
    return [vh.report(out) for out in llm.generate(prompts, sampling, use_tqdm=False)]


def test_an_idle_engine_leaves_the_tail_and_a_busy_one_claims_the_whole_memory(engine):
    llm, data, prompt, segment = engine
    params, salt = vh.memory_request(data, "alice", FACT_IDS, segment)
    cap = AUTO_RECOMPUTE_TOKENS["cpu"]
    # a nonce after the salt keeps vLLM's prefix cache from serving one request's blocks to the next
    (idle,) = _generate(llm, prompt, params, [f"{salt}:idle"])
    assert idle["fallback"] is None and idle["engine_busy"] is False and idle["recompute_budget"] == cap
    assert 0 < idle["recomputed_tokens"] <= cap  # the last fact, prefilled with the question
    assert idle["injected_tokens"] + idle["recomputed_tokens"] == len(segment)

    burst = _generate(llm, prompt, params, [f"{salt}:b{i}" for i in range(BURST)])
    busy = {"injected_tokens": len(segment), "recomputed_tokens": 0, "recompute_budget": 0, "engine_busy": True,
            "fallback": None}
    assert burst == [busy] * BURST  # every one was queued behind another, or admitted into a full step

    (again,) = _generate(llm, prompt, params, [f"{salt}:again"])
    assert again == idle  # the burst is over: the engine has room again


def test_a_requests_own_budget_is_kept_under_load(engine):
    llm, data, prompt, segment = engine
    params, salt = vh.memory_request(data, "alice", FACT_IDS, segment, recompute_tokens=0)
    reports = _generate(llm, prompt, params, [f"{salt}:{i}" for i in range(4)])
    fixed = {"injected_tokens": len(segment), "recomputed_tokens": 0, "recompute_budget": 0, "engine_busy": None,
             "fallback": None}
    assert reports == [fixed] * 4
