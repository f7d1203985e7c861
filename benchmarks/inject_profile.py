"""Where the time of one injected request goes.

Runs the in-process engine (scheduler, worker and this script in one process,
so one profiler sees all of it) on a model shape with random weights and
random memory (as ``ttft.py``), then:

* times ``generate`` (1 output token, median of ``--reps``) for the question
  alone, KV injection of k facts, and prompt injection of the same tokens;
* profiles ``--profiled`` KV-injected requests with ``torch.profiler`` and
  reports, per request, the host and GPU time inside each step of the
  connector (the ranges are added here, around whatever functions the
  installed InferScale has, so the same script profiles older code too), the
  CUDA synchronisations and memcpys the whole request made against the
  question alone, and the busiest kernels;
* times, without the profiler, the host work of each of vLLM's own steps a
  request goes through (input processing, adding it to the engine core,
  scheduling, the model runner, output processing) for the question alone,
  the head from vLLM's prefix cache and KV injection, in the same interleaved
  rounds: what a request with memory costs on the host beyond the connector's
  own steps.

    python benchmarks/inject_profile.py --cuda-graphs --k 50 --out benchmarks/results/inject_profile.json

Point ``PYTHONPATH`` at another checkout to profile that code.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from ttft import SHAPES, fused, parse_store, write_memory  # noqa: E402

#: (module, attribute path, range name): the steps of an injected request
STEPS = [
    ("inferscale.connector.vllm_adapter", "InferScaleConnector.get_num_new_matched_tokens", "scheduler: plan"),
    ("inferscale.connector.vllm_adapter", "InferScaleConnector.build_connector_meta", "scheduler: metadata"),
    ("inferscale.connector.vllm_adapter", "InferScaleConnector.start_load_kv", "worker: start_load_kv (all)"),
    ("inferscale.inject.loader", "SegmentLoader._gather", "worker: store get + version check"),
    ("inferscale.inject.loader", "SegmentLoader.load", "worker: load (get, RoPE, heads, cast)"),
    ("inferscale.inject.loader", "SegmentLoader.slot_mapping", "worker: slot tensor"),
    ("inferscale.compose.rope", "RotaryEmbedding.rotate", "worker: RoPE"),
    ("inferscale.compose.rope", "RotaryEmbedding.rotate_range", "worker: RoPE"),
    ("inferscale.inject.cache_layout", "CacheLayout.write", "worker: cache writes"),
    ("inferscale.inject.loader", "SegmentLoader.sources", "worker: sources + version check"),
    ("inferscale.inject.fused_write", "write_tokens", "worker: fused cache write"),
    ("inferscale.inject.write_graphs", "WriteGraphs.write", "worker: fused cache write (graph replay)"),
    ("inferscale.connector.vllm_adapter", "InferScaleConnector.wait_for_layer_load", "worker: wait_for_layer_load"),
    ("inferscale.connector.vllm_adapter", "InferScaleConnector.request_finished", "scheduler: request_finished"),
]
#: vLLM's own steps of a request (those the installed vLLM has are timed; nested ones overlap)
ENGINE_STEPS = [
    ("vllm.v1.engine.llm_engine", "LLMEngine.add_request", "vLLM: add_request (frontend, all)"),
    ("vllm.v1.engine.input_processor", "InputProcessor.process_inputs", "vLLM: input processing"),
    ("vllm.v1.engine.output_processor", "OutputProcessor.add_request", "vLLM: output processor add"),
    ("vllm.v1.engine.core", "EngineCore.preprocess_add_request", "vLLM: core request (block hashes)"),
    ("vllm.v1.engine.core", "EngineCore.add_request", "vLLM: core add_request"),
    ("vllm.v1.engine.llm_engine", "LLMEngine.step", "vLLM: engine step (all)"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.schedule", "vLLM: schedule"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_computed_blocks", "vLLM: prefix cache lookup"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.allocate_slots", "vLLM: allocate slots"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.execute_model", "vLLM: execute_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.prepare_inputs", "vLLM: prepare_inputs"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.prepare_attn", "vLLM: prepare_attn"),
    ("vllm.v1.worker.gpu.kv_connector", "ActiveKVConnector.pre_forward", "vLLM: connector pre_forward"),
    ("vllm.v1.worker.gpu.kv_connector", "ActiveKVConnector.post_forward", "vLLM: connector post_forward"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sample_tokens", "vLLM: sample_tokens"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output", "vLLM: update_from_output"),
    ("vllm.v1.engine.output_processor", "OutputProcessor.process_outputs", "vLLM: output processing"),
]
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
               "cudaMemcpyAsync", "cudaStreamWaitEvent", "cudaLaunchKernel", "cudaGraphLaunch")


#: host wall time per range while :data:`TIMING` is on (no profiler: its own overhead inflates host times)
HOST_MS: dict[str, list[float]] = {}
TIMING = [False]


def annotate(steps=STEPS) -> list[str]:
    """Wrap each step that exists in the installed InferScale (or vLLM) in a profiler range and a
    host timer."""
    import torch

    found = []
    for module_name, path, label in steps:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:  # code that predates the module
            continue
        owner_name, _, attr = path.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        fn = getattr(owner, attr, None)
        if fn is None:
            continue

        def wrapped(*args, __fn=fn, __label=label, **kwargs):
            start = time.perf_counter()
            try:
                with torch.profiler.record_function(__label):
                    return __fn(*args, **kwargs)
            finally:
                if TIMING[0]:
                    HOST_MS.setdefault(__label, []).append((time.perf_counter() - start) * 1e3)

        setattr(owner, attr, functools.wraps(fn)(wrapped))
        found.append(path)
    return found


def bench_salt(config, segment: list[int]) -> str:
    """The cache salt of user "bench"'s segment: keyed with the data directory's secret, or
    (the code before keyed salts) the plain hash."""
    try:
        from inferscale.compose.salt import CacheSalts
    except ImportError:
        from inferscale.compose.request import segment_salt

        return segment_salt("bench", segment, 0)
    from inferscale.storage.disk import DiskStore

    epoch = DiskStore(DiskStore.Options(root=str(config.kv_path))).epoch("bench")
    return CacheSalts.from_file(config.secret_path).segment("bench", epoch, segment, 0)


def one(llm, prompt: dict, params: dict | None) -> float:
    from inferscale.connector.compat import greedy_sampling

    p = dict(prompt, cache_salt=prompt.get("cache_salt", "plain") + ":" + uuid.uuid4().hex)
    start = time.perf_counter()
    (out,) = llm.generate([p], greedy_sampling(1, params), use_tqdm=False)
    ms = (time.perf_counter() - start) * 1e3
    if params is not None and not (out.kv_transfer_params or {}).get("inferscale", {}).get("injected_tokens"):
        raise RuntimeError(f"nothing was injected: {out.kv_transfer_params}")
    return ms


def warm_salts(llm, segment: list[int], n: int) -> list[str]:
    """``n`` fresh salts, each with ``segment`` (and one more token) in vLLM's prefix cache."""
    from inferscale.connector.compat import greedy_sampling

    salts = [f"warm:{uuid.uuid4().hex}" for _ in range(n)]
    for salt in salts:
        llm.generate([{"prompt_token_ids": segment + [1000], "cache_salt": salt}], greedy_sampling(1), use_tqdm=False)
    return salts


def cached_one(llm, prompt: dict, salt: str) -> float:
    """ms of one request whose head is already in vLLM's prefix cache under ``salt``."""
    from inferscale.connector.compat import greedy_sampling

    start = time.perf_counter()
    llm.generate([dict(prompt, cache_salt=salt)], greedy_sampling(1), use_tqdm=False)
    return (time.perf_counter() - start) * 1e3


def interleaved(llm, variants: dict, segment: list[int], reps: int) -> tuple[dict[str, float], dict[str, dict]]:
    """Median ms of each variant's ``generate``, and per variant the median host ms inside each
    range (no profiler), measured round by round: one request of each per round, in an order
    shuffled every round (as ``ttft.py`` does), so that a slow phase of the engine or the machine,
    and whatever the request before leaves behind, weigh on all of them alike (measured one variant
    after another, the variant measured first ran 1.5x slower than the rest on one H200 host).
    Variant ``cached`` is the KV prompt with its head served from vLLM's prefix cache."""
    salts = warm_salts(llm, segment, reps + 2) if "cached" in variants else []
    times: dict[str, list[float]] = {name: [] for name in variants}
    host: dict[str, dict[str, list[float]]] = {name: {} for name in variants}
    order = random.Random(0)
    for round_ in range(reps + 2):  # the first two warm up
        names = list(variants)
        order.shuffle(names)
        for name in names:
            prompt, params = variants[name]
            HOST_MS.clear()
            TIMING[0] = True
            try:
                ms = cached_one(llm, prompt, salts[round_]) if name == "cached" else one(llm, prompt, params)
            finally:
                TIMING[0] = False
            times[name].append(ms)
            if round_ >= 2:
                for label, spent in HOST_MS.items():
                    host[name].setdefault(label, []).append(sum(spent))
    medians = {f"{name}_ms": statistics.median(values[2:]) for name, values in times.items()}
    host_ms = {name: {label: statistics.median(values + [0.0] * (reps - len(values)))
                      for label, values in ranges.items()}
               for name, ranges in host.items()}
    return medians, host_ms


def profile(llm, prompt: dict, params: dict | None, n: int) -> dict:
    """Per-request host/GPU ms of each range and counts of CUDA runtime calls."""
    return _profiled(lambda: [one(llm, prompt, params) for _ in range(n)], n)


def profile_cached(llm, prompt: dict, segment: list[int], n: int) -> dict:
    """As :func:`profile`, for requests whose head vLLM's prefix cache serves (warmed first, unprofiled)."""
    salts = warm_salts(llm, segment, n)
    return _profiled(lambda: [cached_one(llm, prompt, salt) for salt in salts], n)


def _profiled(run, n: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=activities) as prof:
        run()
    averages = prof.key_averages()
    labels = {label for _, _, label in STEPS}
    ranges, calls, kernels = {}, {}, []
    for event in averages:
        device_us = getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0))
        if event.key in labels:
            ranges[event.key] = {"host_ms": event.cpu_time_total / 1e3 / n, "gpu_ms": device_us / 1e3 / n,
                                 "calls": event.count / n}
        elif event.key in SYNC_EVENTS:
            calls[event.key] = event.count / n
        self_device = getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0))
        if self_device and getattr(event, "device_type", None) is not None and "cuda" in str(event.device_type).lower():
            kernels.append({"kernel": event.key[:120], "gpu_ms": self_device / 1e3 / n, "calls": event.count / n})
    kernels.sort(key=lambda row: -row["gpu_ms"])
    return {"ranges": ranges, "cuda_calls": calls, "top_kernels": kernels[:15]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--k", type=int, default=50)
    parser.add_argument("--fact-tokens", type=int, default=20)
    parser.add_argument("--prefix-tokens", type=int, default=32)
    parser.add_argument("--question-tokens", type=int, default=16)
    parser.add_argument("--kv-store", default="hbm", help="hbm or pinned, with an option suffix as in ttft.py's "
                        "--kv-stores (e.g. pinned:graphs)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--profiled", type=int, default=5)
    parser.add_argument("--fused-write", action="store_true", help="Config.tuning.fused_write: one kernel per step")
    parser.add_argument("--pinned-reads", choices=["copy", "overlap"], help="Config.tuning.pinned_reads (default: Tuning's)")
    parser.add_argument("--layerwise-write", action="store_true",
                        help="Config.tuning.fused_write = false: whole-tensor ops and one backend write per layer")
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--label", default="", help="what code this is (goes into the JSON)")
    parser.add_argument("--out", default="benchmarks/results/inject_profile.json")
    parser.add_argument("--trace", help="also write Chrome traces (gzipped) of one KV-injected request, one "
                                        "question alone and one prefix-cache hit to TRACE_kv.json.gz, "
                                        "TRACE_none.json.gz and TRACE_cached.json.gz")
    args = parser.parse_args()
    try:
        name, store_options = parse_store(args.kv_store)
    except ValueError as exc:
        parser.error(f"--kv-store {exc}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one process: one profiler sees everything

    import torch
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from inferscale.compose.request import make_params
    from inferscale.config import BackendSpec, Config, Tuning
    from inferscale.connector.engine import kv_transfer_config

    annotated = annotate()
    engine_steps = annotate(ENGINE_STEPS)
    work = Path(tempfile.mkdtemp(prefix="inferscale-profile-"))
    cfg = SHAPES[args.shape]
    model = work / f"{args.shape}-shape"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg))
    _, prefix, facts = write_memory(work, cfg, [args.k], args.fact_tokens, args.prefix_tokens)
    config = Config(model=str(model), data_dir=str(work), kv_store=BackendSpec(name), recompute_tokens=0,
                    tuning=Tuning(**{**fused(args), **store_options}))
    memory = {"gpu_memory_utilization": 0.5} if torch.cuda.is_available() else {"kv_cache_memory_bytes": 256 << 20}
    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=8192, enforce_eager=not args.cuda_graphs, enable_prefix_caching=True,
              kv_transfer_config=KVTransferConfig(**kv_transfer_config(config)), **memory)
    ids = [f"f{i}" for i in range(args.k)]
    segment = prefix + [t for i in ids for t in facts[i].token_ids]
    question = torch.randint(1000, 100000, (args.question_tokens,)).tolist()
    kv_prompt = {"prompt_token_ids": segment + question, "cache_salt": bench_salt(config, segment)}
    params = make_params("bench", ids, 0)
    plain = {"prompt_token_ids": segment + question}
    times, host_ms = interleaved(llm, {"none": ({"prompt_token_ids": question}, None), "kv": (kv_prompt, params),
                                       "cached": (plain, None), "prompt": (dict(plain, cache_salt="text"), None)},
                                 segment, args.reps)
    result = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "label": args.label, "fused_write": fused(args).get("fused_write", "default"), "command": " ".join(["python", *sys.argv]),
        "shape": args.shape, "k": args.k,
        "memory_tokens": len(segment), "kv_store": args.kv_store, "cuda_graphs": args.cuda_graphs,
        "annotated": annotated, "engine_steps": engine_steps, **times,
        "kv_host_ms": host_ms["kv"],
        "engine_host_ms": host_ms,
        "kv": profile(llm, kv_prompt, params, args.profiled),
        "none": profile(llm, {"prompt_token_ids": question}, None, args.profiled),
        "cached": profile_cached(llm, plain, segment, args.profiled),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print_report(result)
    if args.trace:
        for name, (prompt, extra) in {"kv": (kv_prompt, params), "none": ({"prompt_token_ids": question}, None)}.items():
            write_trace(lambda: one(llm, prompt, extra), f"{args.trace}_{name}.json.gz")
        salts = iter(warm_salts(llm, segment, 2))  # one for write_trace's warm-up request, one traced
        write_trace(lambda: cached_one(llm, plain, next(salts)), f"{args.trace}_cached.json.gz")
    os._exit(0)


def write_trace(run, path: str) -> None:
    """A Chrome trace (host and GPU) of ``run()``, gzipped, at ``path``."""
    import gzip
    import shutil

    import torch
    from torch.profiler import ProfilerActivity

    run()  # warm
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=activities) as prof:
        run()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    print(f"trace: {path} ({Path(path).stat().st_size >> 10} KiB)")


def print_report(r: dict) -> None:
    print(f"\n{r['device']} {r['label']}: {r['shape']}, k={r['k']} ({r['memory_tokens']} memory tokens), "
          f"{r['kv_store']}, {'CUDA graphs' if r['cuda_graphs'] else 'eager'}, in-process")
    print(f"generate ms (interleaved rounds): question alone {r['none_ms']:.2f} | KV injection {r['kv_ms']:.2f} "
          f"({r['kv_ms'] / r['none_ms']:.2f}x) | head in prefix cache {r.get('cached_ms', float('nan')):.2f} | "
          f"prompt injection {r['prompt_ms']:.2f}")
    print("\n| step (per request) | calls | host ms | host ms, profiled | GPU ms |\n|---|---|---|---|---|")
    for label, row in r["kv"]["ranges"].items():
        print(f"| {label} | {row['calls']:.0f} | {r['kv_host_ms'].get(label, 0):.3f} | {row['host_ms']:.3f} | "
              f"{row['gpu_ms']:.3f} |")
    engine = r.get("engine_host_ms")
    if engine:
        print("\n| host ms per request (no profiler, median of interleaved rounds) | question alone | "
              "head in prefix cache | KV injection |"
              "\n|---|---|---|---|")
        labels = dict.fromkeys(label for _, _, label in ENGINE_STEPS + STEPS if any(label in engine[n] for n in engine))
        for label in labels:
            print(f"| {label} | " + " | ".join(f"{engine[n].get(label, 0):.3f}" for n in ("none", "cached", "kv"))
                  + " |")
    cached = r.get("cached", {"cuda_calls": {}, "top_kernels": []})
    print("\n| CUDA runtime call | KV injection | head in prefix cache | question alone |\n|---|---|---|---|")
    for name in SYNC_EVENTS:
        print(f"| {name} | {r['kv']['cuda_calls'].get(name, 0):.0f} | {cached['cuda_calls'].get(name, 0):.0f} | "
              f"{r['none']['cuda_calls'].get(name, 0):.0f} |")
    print("\n| kernel (KV injection) | calls | GPU ms |\n|---|---|---|")
    for row in r["kv"]["top_kernels"][:10]:
        print(f"| {row['kernel'][:80]} | {row['calls']:.0f} | {row['gpu_ms']:.3f} |")
    for name, title in (("cached", "head in prefix cache"), ("none", "question alone")):
        print(f"\n| kernel ({title}) | calls | GPU ms |\n|---|---|---|")
        for row in r.get(name, {}).get("top_kernels", [])[:10]:
            print(f"| {row['kernel'][:80]} | {row['calls']:.0f} | {row['gpu_ms']:.3f} |")


if __name__ == "__main__":
    main()
