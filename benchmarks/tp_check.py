"""KV injection under tensor parallelism: each rank writes its own KV heads, outputs match TP = 1.

    python benchmarks/tp_check.py --tp 1,2 --out benchmarks/results/tp_check_h200x2.json   # 2 GPUs

For each tiny model variant (``tests/tiny_models.py``: ``llama-kv8``, 8 KV heads, 4 per rank at
TP = 2 like Llama-3.1-8B; ``llama-kv1``, one KV head, replicated on both ranks) it stores a user's
facts (each encoded behind the prefix and the facts before it, so that injection is exact up to
rounding), then for every TP size starts vLLM's multiprocess engine with the connector and runs
the same prompt greedily twice: plain prefill, and with the facts' K/V injected. Reported:

* per TP size, injection vs plain prefill: max |Δlogprob| over the steps both agree on, and the
  number of leading tokens that agree;
* TP = n vs TP = 1, for plain prefill and for injection: the same two numbers.

Set ``INFERSCALE_TEST_CUDA_GRAPHS=1`` to capture CUDA graphs (the harness runs eager otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

FACTS = ["Alice has a cat named Miso.", "Alice works as a nurse in Lisbon.", "Alice plays the cello on Sundays.",
         "Alice's brother Tom lives in Porto and builds boats."]
QUERY = "Where does my brother live, and what does he build?"


def run_variant(variant: str, dtype: str, tps: list[int], max_tokens: int) -> dict:
    import tiny_models
    import vllm_harness as vh

    path = tiny_models.tiny_model_dir(variant, "float32")
    data = Path(tempfile.mkdtemp(prefix=f"tp-{variant}-"))
    prompt, segment = vh.joint_memory(path, data, "alice", FACTS, QUERY)
    params, salt = vh.memory_request(data, "alice", [f"f{i}" for i in range(len(FACTS))], segment)
    outs = {}
    for tp in tps:
        extra = {"distributed_executor_backend": "mp"} if tp > 1 else {}
        llm = vh.make_engine(path, data, dtype, multiprocess=True, tensor_parallel_size=tp, **extra)
        try:
            plain_tokens, _, plain = vh.greedy(llm, prompt, max_tokens=max_tokens)
            tokens, _, injected = vh.greedy(llm, prompt, params, salt, max_tokens=max_tokens)
        finally:
            vh.close_engine(llm)
        outs[tp] = {"plain": plain, "injected": injected, "report": vh.report(injected),
                    "plain_tokens": plain_tokens, "tokens": tokens}
        print(f"{variant} TP={tp}: report {outs[tp]['report']}", flush=True)
    rows = []
    for tp, out in outs.items():
        gap, agree = vh.logprob_gap(out["injected"], out["plain"])
        row = {"variant": variant, "tp": tp, "injected_tokens": out["report"].get("injected_tokens"),
               "fallback": out["report"].get("fallback"), "inject_vs_plain_gap": gap, "inject_vs_plain_agree": agree,
               "tokens": len(out["tokens"])}
        if tp != tps[0]:
            for kind in ("plain", "injected"):
                gap, agree = vh.logprob_gap(out[kind], outs[tps[0]][kind])
                row[f"{kind}_vs_tp{tps[0]}_gap"], row[f"{kind}_vs_tp{tps[0]}_agree"] = gap, agree
        rows.append(row)
    return {"variant": variant, "model": str(path), "segment_tokens": len(segment), "prompt_tokens": len(prompt),
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes, the first is the reference")
    parser.add_argument("--variants", default="llama-kv8,llama-kv1")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", default="benchmarks/results/tp_check.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on the lent machines
    tps = [int(t) for t in args.tp.split(",")]
    results = [run_variant(v, args.dtype, tps, args.max_tokens) for v in args.variants.split(",")]
    try:
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        device, count = "unknown", 0
    result = {"command": " ".join(["python", *sys.argv]), "device": device, "gpus": count, "dtype": args.dtype,
              "cuda_graphs": os.environ.get("INFERSCALE_TEST_CUDA_GRAPHS") == "1", "variants": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print("| model | TP | injected | injection vs plain: max |Δlogprob| (tokens agreeing) | plain vs TP=1 | "
          "injection vs TP=1 |\n|---|---|---|---|---|---|")
    ok = True
    for variant in results:
        for r in variant["rows"]:
            ref = f"tp{tps[0]}"
            vs = lambda kind: (f"{r[f'{kind}_vs_{ref}_gap']:.2e} ({r[f'{kind}_vs_{ref}_agree']}/{r['tokens']})"
                               if f"{kind}_vs_{ref}_gap" in r else "—")
            print(f"| {r['variant']} | {r['tp']} | {r['injected_tokens']} | {r['inject_vs_plain_gap']:.2e} "
                  f"({r['inject_vs_plain_agree']}/{r['tokens']}) | {vs('plain')} | {vs('injected')} |")
            ok &= r["injected_tokens"] == variant["segment_tokens"] and r["fallback"] is None
    os._exit(0 if ok else 1)  # vLLM's engine threads can keep the interpreter alive


if __name__ == "__main__":
    main()
