"""A program that embeds InferScale: it does torch work, writes a user's memory,
then starts vLLM's multiprocess engine with the connector (vLLM's default start
method) and asks one question with that memory.

    python tests/engine_start_probe.py MODEL_DIR DATA_DIR DTYPE

Prints one JSON line: the injected tokens and whether the answer matches plain
prefill. ``tests/test_connector_engines.py`` runs it in a fresh interpreter
under a timeout; on the GPU machine this start used to hang.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import vllm_harness as vh  # noqa: E402

FACTS = ["Alice has a cat named Miso.", "Alice works as a nurse in Lisbon."]


def main(model_dir: str, data_dir: str, dtype: str) -> dict:
    torch.cuda.is_available()  # what most programs ask first
    torch.randn(256, 256) @ torch.randn(256, 256)  # CPU work: torch's thread pool is up
    prompt, segment = vh.joint_memory(Path(model_dir), Path(data_dir), "alice", FACTS, "What is my cat called?")

    from inferscale.connector.compat import shutdown
    from inferscale.connector.engine import make_llm

    config = vh.engine_config(Path(model_dir), Path(data_dir), dtype)
    llm = make_llm(model_dir, config, in_process=False, max_model_len=1024, enforce_eager=True,
                   kv_cache_memory_bytes=128 << 20, seed=0)
    plain, _, _ = vh.greedy(llm, prompt)
    params, salt = vh.memory_request("alice", ["f0", "f1"], segment)
    tokens, _, out = vh.greedy(llm, prompt, params, salt)
    shutdown(llm)
    return {"injected_tokens": vh.report(out).get("injected_tokens"), "segment_tokens": len(segment),
            "same_answer": tokens == plain}


if __name__ == "__main__":
    faulthandler.dump_traceback_later(int(os.environ.get("PROBE_TIMEOUT", "600")), exit=True)
    print(json.dumps(main(*sys.argv[1:4])), flush=True)
    os._exit(0)  # vLLM's engine threads can keep the interpreter alive
