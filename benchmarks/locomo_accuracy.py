"""LoCoMo answer accuracy: KV injection (several ways) vs prompt injection, on the same retrieved facts.

Every conversation in ``--data`` loads (all sessions; facts are LoCoMo's observations, dated by
session, encoded behind their source turn) and every category-1–4 question is asked, or a
stratified, seeded subsample with ``--sample N`` (for CPU smoke runs only). For each question the
top-k facts are retrieved once (the configured embedder and the exact retriever); every method
answers from exactly those facts, so methods differ only in how the facts reach the KV cache:

* ``prompt*`` — the facts prefilled as text (prompt injection, the Mem0-style baseline);
* ``kv*``     — the facts' stored K/V injected by the connector, with a recompute budget
  (the tail facts that fit are prefilled), a key scale, a fact style (bullet / line), a
  closing line after the facts (prefilled) and an encoding window (turns before each fact).

All prompts of one (method, k) go to vLLM in one ``generate`` call. Scores: LoCoMo's token F1
and containment (the normalised gold answer appears in the answer), per category and overall;
retrieval recall@k of the questions' evidence turns (a fact covers the turns it cites).

    python benchmarks/locomo_accuracy.py --data ../shared/data/locomo --methods grid \\
        --ks 5,10,20,50 --out benchmarks/results/locomo_qwen05_h200.json
    python benchmarks/locomo_accuracy.py --sample 60 --ks 5,10 --methods smoke   # CPU smoke run

Writes ``--out`` (config, summary, recall) with the per-question answers beside it
(``*_answers.json.gz``) and a markdown table (``*.md``). The harness itself is the library
``benchmarks/locomo/`` (re-exported here for the scripts and tests that import it from this file).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from locomo import *  # noqa: E402,F401,F403  the library, re-exported: earlier users import it from here
from locomo import (CLOSINGS, INSTRUCTION, Contexts, Prompts, build_engine, cache_salts, encode_all,  # noqa: E402
                    kv_encodings, load_items, make_items, needed_facts, recall_at, related_ranks, retrieve,
                    run_method, select_methods, summarize, usable, write_results)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/data/locomo", help="folder of LoCoMo conversation files")
    parser.add_argument("--sample", type=int, default=0, help="stratified subsample of N questions (CPU smoke runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ks", default="5,10,20,50")
    parser.add_argument("--methods", default="grid", help="a set (grid, smoke, default) or names joined by ';'")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="HF directory or known model name")
    parser.add_argument("--dtype", default=None, help="serving dtype (default: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--embedder", default="minilm")
    parser.add_argument("--retrieval", default=None, help="retrieval cache (JSON): read if present, else written")
    parser.add_argument("--related", default=None, help="cache of each fact's nearest facts (JSON), as --retrieval")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--encode-batch", type=int, default=16)
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6, help="the engine's share of the GPU")
    parser.add_argument("--kv-cache-gib", type=float, default=0,
                        help="a KV cache of this size instead of one sized by a memory profile (GPU)")
    parser.add_argument("--time-limit", type=float, default=0, help="stop starting new methods after this many s")
    parser.add_argument("--default", default=None, help="the method the product serves by default (a name)")
    parser.add_argument("--baseline", default=None, help="the prompt-injection method it is held against")
    parser.add_argument("--out", default="benchmarks/results/locomo_accuracy.json")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from inferscale.encode.weights import model_dir as known_model_dir

    gpu = torch.cuda.is_available()
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    ks = [int(k) for k in args.ks.split(",")]
    methods = usable(select_methods(args.methods))
    model = args.model if os.path.isdir(args.model) else str(known_model_dir(args.model, args.dtype))
    convs, keys = load_items(args)
    retrieved = retrieve(convs, keys, max(50, *ks), Path(args.retrieval) if args.retrieval else None, args.embedder)
    items = make_items(convs, keys, retrieved, max(ks))
    recall_k = recall_at(items, convs, ks)
    print(f"{len(items)} questions from {len(convs)} conversations; recall@k: "
          + ", ".join(f"{k}: {v['all']:.3f}" for k, v in recall_k.items()), flush=True)

    from transformers import AutoTokenizer

    prompts = Prompts(AutoTokenizer.from_pretrained(model), convs)
    data_dir = Path(tempfile.mkdtemp(prefix="locomo-"))
    start = time.perf_counter()
    encodings = kv_encodings(methods)
    needed = needed_facts(items, max(ks))
    ranks = related_ranks(convs, Path(args.related) if args.related else None, args.embedder) \
        if any(e[2] for e in encodings) else {}
    fact_ids = encode_all(args, convs, needed, encodings, model, data_dir, prompts.prefix, getattr(torch, args.dtype),
                          ranks)
    encode_s = time.perf_counter() - start
    if gpu:
        torch.cuda.empty_cache()
    llm = build_engine(args, model, data_dir)
    salt_of = cache_salts(data_dir)
    rows, timing = [], {}
    device = torch.cuda.get_device_name() if gpu else "cpu"
    meta = {"command": " ".join(["python", *sys.argv]), "device": device, "model": Path(model).name,
            "dtype": args.dtype, "instruction": INSTRUCTION, "closings": CLOSINGS, "ks": ks,
            "questions": len(items), "facts": sum(len(c.all_facts()) for c in convs.values()),
            "conversations": sorted(convs), "sample": args.sample, "seed": args.seed,
            "methods": [asdict(m) for m in methods], "encode_s": encode_s, "recall": recall_k,
            "default": args.default, "baseline": args.baseline}
    began, contexts = time.perf_counter(), Contexts(ranks)
    for method in methods:
        if args.time_limit and time.perf_counter() - began > args.time_limit:
            print(f"time limit reached: {method.name} and the methods after it were not run", flush=True)
            break
        for k in ks:
            start = time.perf_counter()
            rows += run_method(llm, method, k, items, prompts, fact_ids, args.max_tokens, salt_of, contexts)
            timing[f"{method.name}@{k}"] = time.perf_counter() - start
            s = summarize([r for r in rows if r["method"] == method.name and r["k"] == k], items)[method.name][str(k)]
            print(f"{method.name:44s} k={k:2d}  F1 {s['f1.all']:.3f}  contains {s['contains.all']:.3f}  "
                  f"recomputed {s['recomputed']:.0f}  fallbacks {s['fallbacks']}  ({timing[f'{method.name}@{k}']:.1f} s)",
                  flush=True)
        table = write_results(Path(args.out), meta, timing, rows, items, methods, ks)
    print("\n" + table, flush=True)
    os._exit(0)  # vLLM's engine threads can keep the interpreter alive


if __name__ == "__main__":
    main()
