"""The connector under other engine set-ups: vLLM's default multiprocess engine
(what `vllm serve` uses) and prefix caching off."""

from __future__ import annotations

import pytest

import tiny_models
import vllm_harness as vh

pytestmark = pytest.mark.slow

FACTS = ["Alice has a cat named Miso.", "Alice works as a nurse in Lisbon."]


def _memory(tmp_path, arch: str):
    path = tiny_models.tiny_model_dir(arch, "float32")
    prompt, segment = vh.joint_memory(path, tmp_path, "alice", FACTS, "What is my cat called?")
    return path, prompt, segment


@pytest.mark.parametrize("multiprocess, prefix_caching", [(True, True), (False, False)],
                         ids=["multiprocess", "no-prefix-caching"])
def test_injection_in_engine_setups(tmp_path, multiprocess, prefix_caching):
    path, prompt, segment = _memory(tmp_path, "qwen2")
    llm = vh.make_engine(path, tmp_path, "float32", multiprocess=multiprocess, prefix_caching=prefix_caching)
    try:
        plain_tokens, _, plain = vh.greedy(llm, prompt)
        params, salt = vh.memory_request("alice", ["f0", "f1"], segment)
        tokens, _, out = vh.greedy(llm, prompt, params, salt)
        assert vh.report(out)["injected_tokens"] == len(segment)
        assert out.num_cached_tokens == len(segment)
        assert tokens == plain_tokens
        assert vh.logprob_gap(out, plain)[0] < 1e-3
        # a failure in this set-up still falls back cleanly
        tokens, _, out = vh.greedy(llm, prompt, vh.memory_request("bob", ["f0"], segment)[0], salt)
        assert vh.report(out)["fallback"] == "unknown_user" and tokens == plain_tokens
    finally:
        vh.close_engine(llm)


def test_injection_under_tensor_parallelism(tmp_path):
    """TP=2 on the CPU backend: each rank writes only its own KV heads."""
    path, prompt, segment = _memory(tmp_path, "qwen3")
    with vh.env(VLLM_CPU_OMP_THREADS_BIND="0|1"):  # one core per rank (vLLM binds by NUMA node otherwise)
        llm = vh.make_engine(path, tmp_path, "float32", multiprocess=True, tensor_parallel_size=2,
                             distributed_executor_backend="mp")
    try:
        plain_tokens, _, plain = vh.greedy(llm, prompt)
        params, salt = vh.memory_request("alice", ["f0", "f1"], segment)
        tokens, _, out = vh.greedy(llm, prompt, params, salt)
        assert vh.report(out)["injected_tokens"] == len(segment)
        assert tokens == plain_tokens
        assert vh.logprob_gap(out, plain)[0] < 1e-3
    finally:
        vh.close_engine(llm)


def test_multiprocess_engine_starts_after_torch_work_in_the_parent(tmp_path):
    """A program that runs torch (and asks for CUDA) before it starts the multiprocess
    engine through InferScale, with vLLM's default start method, gets an engine that
    injects memory (this start hung on a GPU machine)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = tiny_models.tiny_model_dir("qwen2", "float32")
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_WORKER_MULTIPROC_METHOD",
                                                              "VLLM_ENABLE_V1_MULTIPROCESSING")}
    probe = Path(__file__).with_name("engine_start_probe.py")
    done = subprocess.run([sys.executable, str(probe), str(path), str(tmp_path), "float32"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"injected_tokens": result["segment_tokens"], "segment_tokens": result["segment_tokens"],
                      "same_answer": True}
