"""The connector under other engine set-ups: vLLM's default multiprocess engine
(what `vllm serve` uses) and prefix caching off."""

from __future__ import annotations

import pytest
import torch

import tiny_models
import vllm_harness as vh
from inferscale.compose.request import make_params

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
        params, salt = vh.memory_request(tmp_path, "alice", ["f0", "f1"], segment)
        tokens, _, out = vh.greedy(llm, prompt, params, salt)
        assert vh.report(out)["injected_tokens"] == len(segment)
        assert out.num_cached_tokens == len(segment)
        assert tokens == plain_tokens
        assert vh.logprob_gap(out, plain)[0] < 1e-3
        # a failure in this set-up still falls back cleanly
        tokens, _, out = vh.greedy(llm, prompt, make_params("bob", ["f0"]), salt)
        assert vh.report(out)["fallback"] == "refused" and tokens == plain_tokens
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
        params, salt = vh.memory_request(tmp_path, "alice", ["f0", "f1"], segment)
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


def test_injection_from_fp8_at_rest(tmp_path, qwen05_dir, error_log):
    """Qwen2.5-Coder-0.5B (keys with a bias of up to ~200) with its memory kept in fp8 on disk and in
    the memory tier: the whole segment is injected and the answer stays close to plain prefill's
    (what the model's own dtype at rest gives exactly in float32); the fp8 K/V are what was read
    (the logprobs moved). Measured on a CPU (float32): at most 0.23, all 8 tokens the same."""
    from inferscale.compose.segment import SYSTEM_USER
    from inferscale.kv_fp8 import FP8_E4M3, Fp8KV, all_at_rest
    from inferscale.storage.disk import DiskStore

    facts = FACTS + ["Alice's brother Tomas repairs old bicycles.", "Alice runs every Sunday by the river."]
    prompt, segment = vh.joint_memory(qwen05_dir, tmp_path, "alice", facts, "What is my cat called?")
    disk = DiskStore(DiskStore.Options(root=str(tmp_path / "kv")))
    for user in (SYSTEM_USER, "alice"):  # as a server set to fp8 stores them
        disk.put(user, all_at_rest(disk.load_user(user), FP8_E4M3))
    assert all(isinstance(kv, Fp8KV) for kv in disk.load_user("alice").values())
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # (FlashAttention has no float32)
    llm = vh.make_engine(qwen05_dir, tmp_path, dtype, kv_dtype_at_rest=FP8_E4M3)
    try:
        plain_tokens, _, plain = vh.greedy(llm, prompt)
        params, salt = vh.memory_request(tmp_path, "alice", [f"f{i}" for i in range(len(facts))], segment)
        tokens, _, out = vh.greedy(llm, prompt, params, salt)
        delta, agree = vh.logprob_gap(out, plain)
        error_log["fp8 at rest: max|Δlogprob|, tokens agreeing"] = (delta, agree)
        assert vh.report(out) == {"injected_tokens": len(segment), "recomputed_tokens": 0, "recompute_budget": 0,
                                  "engine_busy": None, "fallback": None}
        assert 1e-4 < delta < 0.5, delta
        assert tokens[:4] == plain_tokens[:4] and agree >= len(tokens) // 2, (tokens, plain_tokens)
    finally:
        vh.close_engine(llm)
