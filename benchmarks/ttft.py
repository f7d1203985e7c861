"""Engine TTFT with memory: no memory vs KV injection vs prompt injection, over k.

Runs a Llama-3.1-8B-shaped model with random weights (``load_format="dummy"``:
true timings, meaningless text) under vLLM with the InferScale connector.
Facts are random pre-RoPE K/V of ``--fact-tokens`` tokens each (k = 50 × 20
tokens ≈ 1,000 tokens ≈ 128 MiB of bf16 K/V for this shape).

For every k it measures the wall time of ``LLM.generate`` with one output
token (median of ``--reps``, the variants interleaved round by round in a
shuffled order), each request with a fresh cache salt so vLLM's prefix cache
never helps. Differences between variants are also taken within each round
(``kv_minus_none_ms``: the median over rounds of KV − none), which drift
between rounds does not blur as it blurs a difference of two medians; a
distribution-free 95 % interval of that median (``kv_minus_none_ci_ms``,
``kv_vs_none_paired_ci``) says whether a goal was met or the run cannot tell
(``goal``: met when the whole interval is under it), and every round's times are
kept (``rounds_ms``):

* ``none``   — the question alone (the floor: no memory at all);
* ``kv``     — ``[prefix | k facts | question]`` with the facts injected, once per recompute
  budget B in ``--recompute`` (the tail facts that fit in B tokens are prefilled with the question);
* ``cached`` — the same split served from vLLM's own prefix cache instead of the connector (the
  head warmed by an untimed request with the same salt): what a budget costs once injection
  itself is free;
* ``prompt`` — the same token ids prefilled as text (prompt injection).

It also times the store's ``get`` of the k facts onto the GPU against one
pinned host→device copy of the same bytes (the PCIe floor), and with
``--embedder DIR`` (a sentence-transformers model) the *query-to-first-token*
time ``q2ft``: embed the question text on the GPU, retrieve the top k of the
user's facts with the exact retriever on the GPU, compose the request (the
facts' token ids from the store's index, the salt, the params) and generate
with KV injection, all timed together.

    python benchmarks/ttft.py --cuda-graphs --kv-stores hbm,pinned --out benchmarks/results/ttft_h200.json

Each store gets its own engine, one after the other, in the same run (the
multiprocess engine unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); a PNG plot
is written next to the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}

QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 1000000.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16", "use_sliding_window": False,
}
QWEN3_14B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 5120,
    "intermediate_size": 17408, "num_hidden_layers": 40, "num_attention_heads": 40,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
    "rope_theta": 1000000.0, "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}

#: the same architecture, tiny, to check the script on a CPU machine
SMOKE = {**LLAMA_31_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 128256}
SHAPES = {"llama-3.1-8b": LLAMA_31_8B, "qwen2.5-7b": QWEN25_7B, "qwen3-14b": QWEN3_14B, "smoke": SMOKE}


def kv_shape(cfg: dict) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of a model shape: one token's K or V per layer and head."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"], cfg["num_key_value_heads"], head_dim


def write_memory(data: Path, cfg: dict, ks: list[int], fact_tokens: int, prefix_tokens: int, seed: int = 0,
                 min_facts: int = 0):
    import torch

    from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER
    from inferscale.kv import FactKV
    from inferscale.storage.disk import DiskStore

    shape = kv_shape(cfg)
    gen = torch.Generator().manual_seed(seed)

    def fact(n: int) -> FactKV:
        ids = torch.randint(1000, 100000, (n,), generator=gen).tolist()
        kv = torch.randn((2, shape[0], n, *shape[1:]), generator=gen).to(torch.bfloat16)
        return FactKV(ids, kv[0], kv[1])

    disk = DiskStore(DiskStore.Options(root=str(data / "kv")))
    prefix = fact(prefix_tokens)
    disk.put(SYSTEM_USER, {PREFIX_FACT: prefix})
    facts = {f"f{i}": fact(fact_tokens) for i in range(max(*ks, min_facts))}
    disk.put("bench", facts)
    return disk, list(prefix.token_ids), facts


def time_generate(llm, variants: dict[str, tuple[dict, dict | None, int]], reps: int) -> dict[str, tuple[list[float], int]]:
    """ms of one-token ``generate`` per variant (name → prompt, params, warm tokens), one entry
    per round, and its cached-token count. Measured round by round — one request of each variant
    per round, in an order shuffled every round (seeded) — so that a slow phase of the engine or
    the machine, and whatever the request before leaves behind, weigh on all of them alike. Every
    request gets a fresh cache salt; with ``warm tokens``, an untimed request for the prompt's
    first tokens (same salt) fills vLLM's prefix cache at the start of the round, before any
    timed request (right before its own, every such variant would follow a long prefill)."""
    from inferscale.connector.compat import greedy_sampling

    def one(p: dict, extra: dict | None):
        sp = greedy_sampling(1, extra)
        start = time.perf_counter()
        (out,) = llm.generate([p], sp, use_tqdm=False)
        return (time.perf_counter() - start) * 1e3, out.num_cached_tokens

    times: dict[str, list[float]] = {name: [] for name in variants}
    cached: dict[str, int] = {}
    order = random.Random(0)
    for _ in range(reps + 1):  # the first round warms every shape up
        names = list(variants)
        order.shuffle(names)
        requests = {name: dict(prompt, cache_salt=(prompt.get("cache_salt", "plain") + ":" + uuid.uuid4().hex))
                    for name, (prompt, _, _) in variants.items()}
        for name, (_, _, warm_tokens) in variants.items():
            if warm_tokens:
                p = requests[name]
                one(dict(p, prompt_token_ids=p["prompt_token_ids"][:warm_tokens + 1]), None)
        for name in names:
            ms, cached[name] = one(requests[name], variants[name][1])
            times[name].append(ms)
    return {name: (values[1:], cached[name]) for name, values in times.items()}


def paired_median(a: list[float], b: list[float]) -> float:
    """Median over rounds of ``a - b``: the difference two variants make within a round, free of
    the drift between rounds that the difference of two medians carries."""
    return statistics.median(x - y for x, y in zip(a, b))


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of what ``values`` were drawn from: the
    order statistics ``r`` and ``n + 1 - r`` (1-based), with ``r`` the largest for which
    ``P(Binomial(n, 1/2) < r) ≤ (1 - confidence) / 2``, so that the interval covers the median
    with at least ``confidence`` (NaN, NaN when too few values for it)."""
    n, tail = len(values), (1 - confidence) / 2
    below, r = 0.0, 0  # below: P(Binomial(n, 1/2) < r + 1) as r grows
    while r < n // 2:
        below += math.comb(n, r) / 2 ** n
        if below > tail:
            break
        r += 1
    if r == 0:
        return math.nan, math.nan
    ordered = sorted(values)
    return ordered[r - 1], ordered[n - r]


def paired_interval(a: list[float], b: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """:func:`median_interval` of the within-round differences ``a - b``."""
    return median_interval([x - y for x, y in zip(a, b)], confidence)


def store_get_times(disk, facts, ks, reps: int) -> dict:
    """ms of pinned/hbm ``get`` of k facts onto the GPU vs one raw pinned copy of the same bytes."""
    import torch

    from inferscale.storage.hbm import HBMStore
    from inferscale.storage.pinned import PinnedHostStore

    if not torch.cuda.is_available():
        return {}
    out = {}
    stores = {"pinned": PinnedHostStore(PinnedHostStore.Options()), "hbm": HBMStore(HBMStore.Options())}
    for store in stores.values():
        store.put("bench", facts)

    def cuda_ms(fn) -> float:
        samples = []
        for _ in range(reps + 2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples[2:])

    for k in ks:
        ids = [f"f{i}" for i in range(k)]
        nbytes = sum(facts[i].nbytes for i in ids)
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        floor = cuda_ms(lambda: host.to("cuda", non_blocking=True))
        row = {"bytes": nbytes, "pcie_floor_ms": floor}
        for name, store in stores.items():
            row[f"{name}_get_ms"] = cuda_ms(lambda s=store: s.get("bench", ids, "cuda"))
        row["pinned_vs_floor"] = row["pinned_get_ms"] / floor
        out[k] = row
    return out


#: the TTFT goals at k = 50 and 100 (CUDA graphs, multiprocess engine): KV injection from GPU memory
#: within this factor of the question alone; from pinned host memory, KV − none within this
#: factor of the PCIe copy of the same bytes
HBM_GOAL, PINNED_GOAL = 1.10, 1.2
#: the ks the goals are set at (at k = 1 the pinned goal would ask for 0.08 ms: less than any step's fixed cost)
GOAL_KS = (50, 100)
#: KV injection within this many ms of vLLM's own prefix-cache hit of the same head (every store and budget)
PREFIX_CACHE_GOAL_MS = 1.0


def prefix_cache_goal(row: dict) -> dict | None:
    """KV − prefix cache (the same head served from vLLM's own cache) held against
    :data:`PREFIX_CACHE_GOAL_MS`, read as :func:`goal` reads its interval; None without a
    prefix cache or at a k no goal is set at."""
    if row["k"] not in GOAL_KS or math.isnan(row["cached_ms"]):
        return None
    low, high = row["kv_minus_cached_ci_ms"]
    verdict = "met" if high <= PREFIX_CACHE_GOAL_MS else "missed" if low > PREFIX_CACHE_GOAL_MS else "undecided"
    return {"measured": "KV − prefix cache ms", "limit": PREFIX_CACHE_GOAL_MS, "verdict": verdict}


def goal(row: dict, gets: dict) -> dict | None:
    """A full-injection row (budget 0) held against its store's goal: ``met`` when the whole 95 %
    interval is under the limit, ``missed`` when all of it is over, else ``undecided`` (the run
    cannot tell); None for other rows, rows at a k the goals are not set at (:data:`GOAL_KS`), or
    pinned rows without a PCIe floor (no GPU)."""
    store = row["kv_store"].partition(":")[0]
    if row["recompute_tokens"] != 0 or row["k"] not in GOAL_KS:
        return None
    if store == "hbm":
        limit, (low, high), measured = HBM_GOAL, row["kv_vs_none_paired_ci"], "KV / none"
    elif store == "pinned" and row["k"] in gets:
        limit = PINNED_GOAL * gets[row["k"]]["pcie_floor_ms"]
        (low, high), measured = row["kv_minus_none_ci_ms"], "KV − none ms"
    else:
        return None
    verdict = "met" if high <= limit else "missed" if low > limit else "undecided"
    return {"measured": measured, "limit": limit, "verdict": verdict}


def goal_cell(verdict: dict | None) -> str:
    if verdict is None:
        return "—"
    return f"{verdict['measured']} ≤ {verdict['limit']:.2f}: {verdict['verdict']}"


def measure(llm, prefix, facts, ks, budgets, question, reps: int, store: str, salts, epoch: str,
            prefix_caching: bool = True) -> list[dict]:
    """One engine's rows: per k and budget, the question alone, KV injection, the head from vLLM's
    prefix cache (NaN when the engine has none) and prompt injection, measured in interleaved rounds."""
    from inferscale.compose.blend import injected_length
    from inferscale.compose.request import make_params

    rows = []
    for k in ks:
        ids = [f"f{i}" for i in range(k)]
        segment = prefix + [t for i in ids for t in facts[i].token_ids]
        lengths = [len(prefix)] + [len(facts[i].token_ids) for i in ids]
        for budget in budgets:
            claim = injected_length(lengths, budget)
            prompt = {"prompt_token_ids": segment + question, "cache_salt": salts.segment("bench", epoch, segment, budget)}
            variants = {
                "none": ({"prompt_token_ids": question}, None, 0),
                "kv": (prompt, make_params("bench", ids, budget), 0),
                "cached": ({"prompt_token_ids": segment + question, "cache_salt": "warm"}, None, claim),
                "prompt": ({"prompt_token_ids": segment + question, "cache_salt": "text"}, None, 0),
            }
            if not prefix_caching:  # nothing to serve the head from: that row is not measured
                del variants["cached"]
            got = time_generate(llm, variants, reps)
            got.setdefault("cached", ([math.nan] * reps, 0))
            (none, _), (kv, injected), (cached, hit), (text, _) = (got[n] for n in ("none", "kv", "cached", "prompt"))
            none_ms, kv_ms, cached_ms, text_ms = (statistics.median(t) for t in (none, kv, cached, text))
            if injected < claim:  # a load failed or fell back: its time is not KV injection's
                raise RuntimeError(f"k={k}, {store}: {injected} of {claim} memory tokens injected "
                                   "(see the engine log for the connector's warning)")
            rows.append({"kv_store": store, "k": k, "recompute_tokens": budget, "memory_tokens": len(segment),
                         "recomputed_tokens": len(segment) - claim, "injected_tokens": injected,
                         "none_ms": none_ms, "kv_ms": kv_ms, "cached_ms": cached_ms, "cached_tokens": hit,
                         "prompt_ms": text_ms, "kv_vs_none": kv_ms / none_ms, "cached_vs_none": cached_ms / none_ms,
                         "prompt_vs_none": text_ms / none_ms, "kv_vs_prompt": kv_ms / text_ms,
                         # within-round differences: what the ≤ 1.1× goal is read off
                         "kv_minus_none_ms": paired_median(kv, none),
                         "cached_minus_none_ms": paired_median(cached, none),
                         "kv_minus_cached_ms": paired_median(kv, cached),
                         "kv_vs_none_paired": 1 + paired_median(kv, none) / none_ms,
                         # 95 % intervals of the medians of those differences (distribution-free)
                         "kv_minus_none_ci_ms": paired_interval(kv, none),
                         "kv_minus_cached_ci_ms": paired_interval(kv, cached),
                         "kv_vs_none_paired_ci": tuple(1 + d / none_ms for d in paired_interval(kv, none)),
                         "rounds_ms": {"none": none, "kv": kv, "cached": cached, "prompt": text}})
    return rows


#: what the query-to-first-token facts say (their K/V is random; only retrieval reads the text)
TOPICS = ["hiking", "cooking", "jazz", "chess", "sailing", "pottery", "tennis", "poetry", "astronomy", "gardening"]


def query_to_first_token(llm, disk, prefix, facts, ks, question, reps: int, salts, embedder_dir: str) -> dict:
    """ms from the question's text to the first token: embed, retrieve top k, compose, generate;
    and two controls for the last step (``generate_after_pause``: the same request after an idle
    pause as long as the first three steps; ``generate_back_to_back``: right after that)."""
    import torch

    from inferscale.compose.request import make_params
    from inferscale.connector.compat import greedy_sampling
    from inferscale.retrieval.embed_local import SentenceTransformerEmbedder
    from inferscale.retrieval.exact import ExactRetriever

    device = "cuda" if torch.cuda.is_available() else "cpu"
    embedder = SentenceTransformerEmbedder(SentenceTransformerEmbedder.Options(model_path=embedder_dir, device=device))
    retriever = ExactRetriever(ExactRetriever.Options(device=device))
    ids = sorted(facts, key=lambda f: int(f[1:]))
    texts = [f"Fact {i}: the user spent week {i} on {TOPICS[i % len(TOPICS)]} with friend number {i // 10}."
             for i in range(len(ids))]
    retriever.add("bench", ids, embedder.embed(texts))
    text = "What did I do on my weekends with my friends last spring?"
    out = {}
    for k in ks:
        def one() -> dict[str, float]:
            marks = [time.perf_counter()]
            query = embedder.embed([text])
            marks.append(time.perf_counter())
            (hits,) = retriever.search("bench", query, k)
            marks.append(time.perf_counter())
            order = [hit.fact_id for hit in hits]
            segment = list(prefix)
            for token_ids in disk.token_ids("bench", order):
                segment.extend(token_ids)
            salt = salts.segment("bench", disk.epoch("bench"), segment, 0)
            prompt = {"prompt_token_ids": segment + question, "cache_salt": f"{salt}:{uuid.uuid4().hex}"}
            sampling = greedy_sampling(1, make_params("bench", order, 0))
            marks.append(time.perf_counter())
            llm.generate([prompt], sampling, use_tqdm=False)
            marks.append(time.perf_counter())
            steps = ("embed", "retrieve", "compose", "generate")
            timed = {"total": (marks[-1] - marks[0]) * 1e3,
                     **{name: (b - a) * 1e3 for name, a, b in zip(steps, marks, marks[1:])}}
            # controls for `generate`: the same request after an idle pause as long as embed +
            # retrieve + compose (no GPU or host work in this process), then once more at once
            time.sleep(marks[3] - marks[0])
            for control in ("generate_after_pause", "generate_back_to_back"):
                began = time.perf_counter()
                llm.generate([dict(prompt, cache_salt=f"{salt}:{uuid.uuid4().hex}")], sampling, use_tqdm=False)
                timed[control] = (time.perf_counter() - began) * 1e3
            return timed

        runs = [one() for _ in range(reps + 1)][1:]
        out[k] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    return out


def plot(result: dict, path: Path) -> None:
    """TTFT against k: the question alone, KV injection per store, prompt injection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rows = [r for r in result["rows"] if r["recompute_tokens"] == min(x["recompute_tokens"] for x in result["rows"])]
    stores = sorted({r["kv_store"] for r in rows})
    first = [r for r in rows if r["kv_store"] == stores[0]]
    ks = [r["k"] for r in first]
    ax.plot(ks, [r["none_ms"] for r in first], "k--", label="question alone")
    ax.plot(ks, [r["prompt_ms"] for r in first], "o-", color="tab:red", label="prompt injection")
    for store, color in zip(stores, ("tab:blue", "tab:green")):
        mine = [r for r in rows if r["kv_store"] == store]
        ax.plot([r["k"] for r in mine], [r["kv_ms"] for r in mine], "s-", color=color, label=f"KV injection ({store})")
    ax.set_xlabel("facts k")
    ax.set_ylabel("TTFT, ms (median)")
    ax.set_title(result["model"], fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


#: the Config.tuning a --kv-stores suffix sets (also "programs<n>": pinned_read_programs = n, 0 for one program
#: per token, "groups<n>": pinned_read_launches = n, and "copybelow<n>": pinned_copy_below_mib = n;
#: several joined by "+", e.g. pinned:programs0+groups4)
STORE_OPTIONS = {"copy": {"pinned_reads": "copy"}, "overlap": {"pinned_reads": "overlap"},
                 "launch": {"write_graphs": False}, "graphs": {"pinned_reads": "overlap", "pinned_read_graphs": True},
                 "async": {"async_loads": "always"}, "sync": {"async_loads": "never"}, "auto": {"async_loads": "auto"}}
COUNTED_OPTIONS = {"programs": "pinned_read_programs", "groups": "pinned_read_launches",
                   "copybelow": "pinned_copy_below_mib"}


def store_options(suffix: str) -> dict | None:
    """The Config.tuning options a --kv-stores suffix sets; None for one it does not know, or
    whose values Tuning refuses."""
    from inferscale.config import Tuning
    from inferscale.errors import ConfigError

    if not suffix:
        return {}
    options = {}
    for item in suffix.split("+"):
        name = item.rstrip("0123456789")
        count = item[len(name):]
        if item in STORE_OPTIONS:
            options.update(STORE_OPTIONS[item])
        elif name in COUNTED_OPTIONS and count:
            options.update({"pinned_reads": "overlap", COUNTED_OPTIONS[name]: int(count)})
        else:
            return None
    try:
        Tuning(**options)
    except ConfigError:
        return None
    return options


def parse_store(store: str) -> tuple[str, dict]:
    """A --kv-stores entry as (the memory store's name, the Config options its suffix sets);
    ValueError, saying what is allowed, for an entry either part of which is unknown."""
    name, _, suffix = store.partition(":")
    options = store_options(suffix)
    if name not in ("hbm", "pinned") or options is None:
        raise ValueError(f"{store}: hbm or pinned, with an optional ':' suffix of {', '.join(STORE_OPTIONS)}, "
                         "programs<n>, groups<n>, copybelow<n>, joined by '+'")
    return name, options


def fused(args) -> dict:
    """Config.tuning's fused_write and pinned_reads when asked for (absent from code that predates
    them): the defaults unless ``--fused-write``, ``--layerwise-write`` or (inject_profile.py)
    ``--pinned-reads`` says."""
    asked = {"pinned_reads": args.pinned_reads} if getattr(args, "pinned_reads", None) else {}
    if args.layerwise_write:
        return {**asked, "fused_write": False}
    return {**asked, "fused_write": True} if args.fused_write else asked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default="1,5,10,25,50,100")
    parser.add_argument("--fact-tokens", type=int, default=20)
    parser.add_argument("--prefix-tokens", type=int, default=32)
    parser.add_argument("--question-tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--kv-stores", default="hbm,pinned", help="one engine per store, in this order; "
                        "a suffix sets an option for that engine: pinned:copy or pinned:overlap "
                        "Config.tuning.pinned_reads, pinned:programs0+groups4 pinned_read_programs = 0 (one "
                        "program per token) and pinned_read_launches = 4, "
                        "hbm:launch or pinned:launch write_graphs = false (for pinned: a launch per group of "
                        "layers, no graphs), pinned:graphs pinned_read_graphs = true (the default), "
                        "pinned:copybelow0 pinned_copy_below_mib = 0 (every read in place), "
                        "pinned:async async_loads = \"always\" (loaded beside the batch), pinned:sync "
                        "async_loads = \"never\" (before the forward pass), pinned:auto async_loads = \"auto\"")
    parser.add_argument("--recompute", default="0", help="recompute budgets (tokens) to time KV injection with")
    parser.add_argument("--fused-write", action="store_true", help="Config.tuning.fused_write: one kernel per step")
    parser.add_argument("--layerwise-write", action="store_true",
                        help="Config.tuning.fused_write = false: whole-tensor ops and one backend write per layer")
    parser.add_argument("--cuda-graphs", action="store_true", help="capture CUDA graphs (default: eager)")
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="engines without vLLM's prefix cache (no block hashing; the prefix-cache row is NaN)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per KV cache block (vLLM's block_size; default: vLLM's choice)")
    parser.add_argument("--embedder", default=None, help="a sentence-transformers model directory: also time "
                        "query-to-first-token (embed + retrieve + compose + generate) on the first store's engine")
    parser.add_argument("--out", default="benchmarks/results/ttft.json")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    budgets = [int(b) for b in args.recompute.split(",")]
    stores = args.kv_stores.split(",")
    try:
        parsed = [parse_store(store) for store in stores]
    except ValueError as exc:
        parser.error(f"--kv-stores {exc}")

    import torch
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from inferscale.config import BackendSpec, Config, Tuning
    from inferscale.compose.salt import CacheSalts
    from inferscale.connector.compat import set_engine_environment, platform_device_type, shutdown
    from inferscale.connector.engine import kv_transfer_config

    work = Path(tempfile.mkdtemp(prefix="inferscale-ttft-"))
    cfg = SHAPES[args.shape]
    model = work / f"{args.shape}-shape"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg))
    disk, prefix, facts = write_memory(work, cfg, ks, args.fact_tokens, args.prefix_tokens,
                                       min_facts=200 if args.embedder else 0)
    question = torch.randint(1000, 100000, (args.question_tokens,)).tolist()
    # spawned engine processes: this process has used torch and asked for CUDA (a forked engine hangs)
    set_engine_environment(platform_device_type(), in_process=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0")
    memory = {"gpu_memory_utilization": 0.5} if torch.cuda.is_available() else {"kv_cache_memory_bytes": 256 << 20}
    rows = []
    for store, (name, suffix_options) in zip(stores, parsed):  # "pinned:copy": the pinned store, pinned_reads = "copy"
        options = {**fused(args), **suffix_options}
        config = Config(model=str(model), data_dir=str(work), kv_store=BackendSpec(name), recompute_tokens=0,
                        tuning=Tuning(**options))
        llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  max_model_len=8192, enforce_eager=not args.cuda_graphs, enable_prefix_caching=not args.no_prefix_caching,
                  tensor_parallel_size=args.tp, **({"block_size": args.block_size} if args.block_size else {}),
                  kv_transfer_config=KVTransferConfig(**kv_transfer_config(config)), **memory)
        salts, epoch = CacheSalts.from_file(config.secret_path), disk.epoch("bench")
        rows += measure(llm, prefix, facts, ks, budgets, question, args.reps, store, salts, epoch,
                        prefix_caching=not args.no_prefix_caching)
        if args.embedder and store == stores[0]:
            q2ft = query_to_first_token(llm, disk, prefix, facts, ks, question, args.reps, salts, args.embedder)
            for row in rows:
                if row["kv_store"] == store and row["recompute_tokens"] == budgets[0]:
                    row["q2ft_ms"] = q2ft[row["k"]]["total"]
                    row["q2ft_minus_kv_ms"] = q2ft[row["k"]]["total"] - row["kv_ms"]
                    row["q2ft_steps_ms"] = {key: v for key, v in q2ft[row["k"]].items() if key != "total"}
        shutdown(llm)
        del llm
    gets = store_get_times(disk, facts, ks, args.reps)
    shutil.rmtree(work, ignore_errors=True)  # the model's shape and the facts' K/V
    for row in rows:
        row["goal"] = goal(row, gets)
        row["prefix_cache_goal"] = prefix_cache_goal(row)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    mode = "CUDA graphs" if args.cuda_graphs else "eager"
    engine = "in-process" if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else "multiprocess"
    if args.tp > 1:
        engine += f", tensor parallel {args.tp}"
    from vllm import __version__ as vllm_version

    result = {"device": device, "vllm": vllm_version, "model": f"{args.shape} shape, random weights, bf16, {mode}, {engine} engine",
              "command": " ".join(["python", *sys.argv]), "engine": engine, "kv_stores": stores,
              "tensor_parallel": args.tp, "block_size": args.block_size,
              "prefix_caching": not args.no_prefix_caching, "fused_write": config.tuning.fused_write,
              "fact_tokens": args.fact_tokens, "reps": args.reps, "rows": rows, "store_get": gets}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    try:
        plot(result, out.with_suffix(".png"))
    except ImportError as exc:  # the numbers matter more than the picture
        print(f"no plot ({exc}); draw it later from the JSON")
    print(f"\n{device} — engine TTFT (wall of generate, 1 token, {mode}, {engine}), median of {args.reps}")
    print("| store | k | memory tokens | budget B | injected | no memory ms | KV injection ms | head in prefix "
          "cache ms | prompt injection ms | KV/none | KV/prompt | prompt/none | within rounds: KV − none ms, "
          "prefix cache − none ms, KV/none (95 % interval) | goal (whole interval under it: met) | KV − prefix cache ms "
          "(95 % interval) | goal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kv_store']} | {r['k']} | {r['memory_tokens']} | {r['recompute_tokens']} | "
              f"{r['injected_tokens']} | {r['none_ms']:.2f} | {r['kv_ms']:.2f} | {r['cached_ms']:.2f} | "
              f"{r['prompt_ms']:.2f} | {r['kv_vs_none']:.2f} | {r['kv_vs_prompt']:.2f} | {r['prompt_vs_none']:.2f} | "
              f"{r['kv_minus_none_ms']:.2f}, {r['cached_minus_none_ms']:.2f}, {r['kv_vs_none_paired']:.3f} "
              f"({r['kv_vs_none_paired_ci'][0]:.3f}-{r['kv_vs_none_paired_ci'][1]:.3f}) | {goal_cell(r['goal'])} | "
              f"{r['kv_minus_cached_ms']:.2f} ({r['kv_minus_cached_ci_ms'][0]:.2f}-{r['kv_minus_cached_ci_ms'][1]:.2f}) "
              f"| {goal_cell(r['prefix_cache_goal'])} |")
    if any("q2ft_ms" in r for r in rows):
        print("\n| store | k | KV injection ms | query-to-first-token ms | difference ms | embed | retrieve | compose "
              "| generate | generate after a pause | generate back to back |\n|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if "q2ft_ms" in r:
                steps = " | ".join(f"{r['q2ft_steps_ms'][s]:.2f}" for s in ("embed", "retrieve", "compose", "generate",
                                                                             "generate_after_pause", "generate_back_to_back"))
                print(f"| {r['kv_store']} | {r['k']} | {r['kv_ms']:.2f} | {r['q2ft_ms']:.2f} | {r['q2ft_minus_kv_ms']:.2f} "
                      f"| {steps} |")
    if gets:
        print("\n| k | MiB | PCIe floor ms | pinned get ms | × floor | hbm get ms |\n|---|---|---|---|---|---|")
        for k, g in gets.items():
            print(f"| {k} | {g['bytes'] / 2**20:.1f} | {g['pcie_floor_ms']:.2f} | {g['pinned_get_ms']:.2f} | "
                  f"{g['pinned_vs_floor']:.2f} | {g['hbm_get_ms']:.2f} |")
    os._exit(0)  # vLLM's engine threads can keep the interpreter alive


if __name__ == "__main__":
    main()
