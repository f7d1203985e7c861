"""The connector's host time per injected request, outside the engine, hot and cold.

Each step an injected request takes on the host, called the way the connector calls it, for k
facts of a Llama-3.1-8B K/V shape (random memory as ``ttft.py`` writes it):

* ``plan``      — scheduler: match the prompt against the user's memory (``plan_request``);
* ``metadata``  — scheduler: the load's cache blocks (``load_blocks`` + ``LoadSpec``);
* ``metadata_slots`` — the baseline of ``metadata``: as the scheduler did it before the worker
  derived each token's slot itself, a slot per token (NumPy) and the set of blocks. Not in the sums.
* ``sources``   — worker: the facts' blocks in the memory tier, the check of their epochs and the
  sources table (``SegmentLoader.sources``);
* ``launch``    — worker, on a GPU: the table to the device, the rotary table and the fused
  write's launch on the current stream, with its event (``KVWriter._write_fused``'s work);
* ``graph_launch`` — the same from a CUDA graph (``Config.tuning.write_graphs``): the table into the
  pinned staging buffer, one graph replay, the event. Not in the sums: it replaces ``launch``.
* ``sources_numpy`` — the baseline of ``sources``: the same table built as before the compiled
  loop (the facts' blocks picked and joined, then a dozen NumPy calls). Not in the sums.
* ``sources_per_fact`` — with ``--kv-store pinned`` on a GPU, the baseline of ``sources``: the
  facts copied to the GPU one allocation and one copy call each, as before they were copied into
  one buffer a run of them at a time (:func:`~inferscale.storage.blocks.copy_rows`). Not in the sums.

"cold" first runs unrelated work that sweeps the CPU's caches (64 MiB of memory and a few
thousand Python objects), as the engine's own work between two requests does; "hot" calls the
step again right after. Every round times each step once both ways, the steps in a shuffled
order, so that a host that slows down during the run slows all of them alike. A fixed pure-Python workload (``python_ref_ms``) compares hosts: the engine's host
is often slower than a developer's. Prints a table, writes ``--out`` (JSON).

    python benchmarks/host_path.py --out benchmarks/results/host_path.json
    python benchmarks/host_path.py --kv-store pinned --ks 50 --out benchmarks/results/host_path_pinned.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ttft import SHAPES, kv_shape, write_memory  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from inferscale.compose.blend import Blend  # noqa: E402
from inferscale.compose.rope import RotaryEmbedding  # noqa: E402
from inferscale.compose.salt import CacheSalts  # noqa: E402
from inferscale.inject import fused_write  # noqa: E402
from inferscale.inject.layer_loads import LayerLoads  # noqa: E402
from inferscale.inject.sources import (K_ADDR, LAYER_STRIDE, POSITION, SCALE, SLOT, V_ADDR, Sources,  # noqa: E402
                                       segment_sources)
from inferscale.inject.loader import LoadSpec, SegmentLoader, load_blocks  # noqa: E402
from inferscale.inject.planner import plan_request  # noqa: E402
from inferscale.inject.write_graphs import WriteGraphs  # noqa: E402
from inferscale.storage.hbm import HBMStore  # noqa: E402
from inferscale.storage.pinned import PinnedHostStore  # noqa: E402

BLOCK = 16
_SWEEP = np.ones(64 << 20, dtype=np.uint8)


def sweep() -> None:
    """Touch 64 MiB and make a few thousand Python objects: what a step of the engine does
    to the CPU's caches between two requests."""
    _SWEEP.sum()
    {i: str(i) for i in range(4000)}  # noqa: B018


def python_ref() -> None:
    """A fixed pure-Python workload (dicts, lists, ints): host speed, comparable across machines."""
    table = {}
    for i in range(20000):
        table[i % 977] = table.get(i % 977, 0) + i * 3
    sorted(table.values())


def median_ms(work, reps: int, cold: bool) -> float:
    times = []
    for rep in range(reps + 1):  # the first one warms up
        if torch.cuda.is_available():  # as in the engine, the GPU has finished the step before
            torch.cuda.synchronize()
        if rep == 0:
            work()
            continue
        if cold:
            sweep()
        began = time.perf_counter()
        work()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def numpy_sources(loader: SegmentLoader, spec: LoadSpec) -> Sources:
    """The sources table as the loader built it before the compiled loop (the baseline of
    ``sources``): the facts' blocks picked and joined to the prefix's, then NumPy over tokens."""
    prefix, facts, rows = loader._held(spec, False)
    held = prefix + (facts if rows is None else facts.select(rows))
    layout, lengths = held.layout, held.lengths
    row, size = layout.num_kv_heads * layout.head_size, layout.dtype.itemsize
    which = np.repeat(np.arange(len(lengths)), lengths)[spec.start:spec.end]
    base = held.addresses - (np.cumsum(lengths) - lengths) * (row * size)
    table = np.empty((6, spec.end - spec.start), dtype=np.int64)
    positions, keys, stride = table[POSITION], table[K_ADDR], table[LAYER_STRIDE]
    positions[:] = np.arange(spec.start, spec.end)
    np.multiply(lengths[which], row, out=stride)
    np.multiply(positions, row * size, out=keys)
    keys += base[which]
    np.multiply(stride, layout.num_layers * size, out=table[V_ADDR])
    table[V_ADDR] += keys
    table[SLOT] = spec.slots
    table[SCALE] = np.float32(1.0).view(np.int32)
    if spec.key_scale != 1.0:
        table[SCALE, max(0, int(prefix.lengths.sum()) - spec.start):] = np.float32(spec.key_scale).view(np.int32)
    return Sources(torch.from_numpy(table), layout.dtype, layout.num_kv_heads, held.blocks)


def per_fact_sources(loader: SegmentLoader, store: PinnedHostStore, spec: LoadSpec) -> Sources:
    """The sources table over the facts copied to the GPU one by one (the baseline of ``sources``
    from the pinned store): an allocation and a copy call per fact, and each block checked."""
    loader._hold(spec.user_id)
    prefix = loader._prefix(False)
    facts = store._copy_each(spec.user_id, spec.request.fact_ids, loader.device)
    return segment_sources(prefix, facts, spec.start, spec.end, spec.blocks, spec.block_size, spec.key_scale)[0]


def rounds_ms(work: dict, reps: int) -> dict[str, float]:
    """Median ms of each step hot and cold (``<name>_hot_ms``, ``<name>_cold_ms``) over ``reps``
    rounds, each timing every step once cold and once hot, in a shuffled order."""
    times: dict[str, list[float]] = {f"{name}_{kind}_ms": [] for name in work for kind in ("hot", "cold")}
    for step in work.values():  # warm-up (compiles what compiles on first use)
        step()
    shuffler = random.Random(0)
    for _ in range(reps):
        for name in shuffler.sample(list(work), len(work)):
            for kind in ("cold", "hot"):
                if torch.cuda.is_available():  # as in the engine, the GPU has finished the step before
                    torch.cuda.synchronize()
                if kind == "cold":
                    sweep()
                began = time.perf_counter()
                work[name]()
                times[f"{name}_{kind}_ms"].append((time.perf_counter() - began) * 1e3)
    return {key: statistics.median(values) for key, values in times.items()}


def steps(k: int, data: Path, device: torch.device, kv_store: str = "hbm") -> dict:
    """The step functions of one request with k facts, its memory in ``kv_store``."""
    cfg = SHAPES["llama-3.1-8b"]
    layers, heads, head_size = kv_shape(cfg)
    disk, prefix, facts = write_memory(data, cfg, [k], 20, 32, min_facts=max(k, 200))
    salts = CacheSalts(b"k" * 32)
    fact_ids = [f"f{i}" for i in range(k)]
    segment = list(prefix) + [t for f in fact_ids for t in facts[f].token_ids]
    params = {"inferscale": {"user_id": "bench", "fact_ids": fact_ids}}
    salt = salts.segment("bench", disk.epoch("bench"), segment)
    prompt = segment + list(range(1000, 1030))
    block_ids = list(range(len(prompt) // BLOCK + 1))
    store = HBMStore(HBMStore.Options(device=str(device))) if kv_store == "hbm" else PinnedHostStore()
    rope = RotaryEmbedding.from_hf_config(AutoConfig.for_model(**cfg))
    loader = SegmentLoader(store, disk, rope, slice(0, heads), device, torch.bfloat16)

    def plan():
        return plan_request(disk, salts, prompt, params, salt, 0, Blend())

    planned = plan()
    if planned.fallback is not None:
        raise RuntimeError(f"the request fell back: {planned.detail}")

    def metadata():
        blocks = load_blocks(block_ids, BLOCK, 0, planned.claim_len)
        set(blocks)  # (the blocks to report should the load fail)
        return LoadSpec("r", planned.request, 0, planned.claim_len, planned.segment_len, blocks, BLOCK,
                        planned.epochs, 1.0)

    def metadata_slots():
        positions = np.arange(0, planned.claim_len, dtype=np.int64)
        slots = np.asarray(block_ids, dtype=np.int64)[positions // BLOCK] * BLOCK + positions % BLOCK
        set(block_ids[:(planned.claim_len - 1) // BLOCK + 1])
        return slots

    spec = metadata()
    out = {"plan": plan, "metadata": metadata, "sources": lambda: loader.sources(spec, layers, head_size),
           "sources_numpy": lambda: numpy_sources(loader, spec), "metadata_slots": metadata_slots}
    if kv_store == "pinned" and device.type == "cuda":
        out["sources_per_fact"] = lambda: per_fact_sources(loader, store, spec)
    if device.type == "cuda" and fused_write.available():
        caches = [torch.zeros(len(block_ids) + 8, heads, BLOCK, 2 * head_size, dtype=torch.bfloat16, device=device)
                  for _ in range(layers)]
        views = fused_write.CacheViews.of([tuple(c.transpose(1, 2).split(head_size, dim=-1)) for c in caches])
        loads = LayerLoads(device, layers)
        ready = loader.sources(spec, layers, head_size)

        def launch():
            with loads.issuing(side_stream=False):
                sources = Sources.join([ready]).to(device)
                cos, sin = rope.table(device, spec.end)
                fused_write.write_tokens(views, sources, cos, sin, 0, rope.rotary_dim, rope.style == "neox")
                loads.all_queued([sources])
            loads.wait_all()
        out["launch"] = launch
        graphs = WriteGraphs(views, 0, rope.rotary_dim, rope.style == "neox")

        def graph_launch():
            with loads.issuing(side_stream=False):
                cos, sin = rope.table(device, spec.end)
                events = graphs.write(Sources.join([ready]), cos, sin)
                if events is None:
                    raise RuntimeError("no graph served the write")
                loads.all_queued([ready], events[-1][1])
            loads.wait_all()
        out["graph_launch"] = graph_launch
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", default="1,50,100")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--kv-store", choices=("hbm", "pinned"), default="hbm",
                        help="the memory tier the facts are read from (pinned: copied to the GPU first)")
    parser.add_argument("--out", default="benchmarks/results/host_path.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ref = median_ms(python_ref, max(1, args.reps // 4), cold=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in (int(k) for k in args.ks.split(",")):
            rows.append({"k": k, **rounds_ms(steps(k, Path(tmp) / f"k{k}", device, args.kv_store), args.reps)})
    names = [key[:-7] for key in rows[0] if key.endswith("_hot_ms")]
    summed = [n for n in names if n not in ("graph_launch", "sources_numpy", "metadata_slots", "sources_per_fact")]
    host = platform.processor() or platform.machine()
    print(f"connector host path per request, ms (median of {args.reps}), {device.type}, {args.kv_store} store, {host}; "
          f"python_ref {ref:.3f} ms")
    print("| k | " + " | ".join(f"{n} hot / cold" for n in names) + " | sum hot / cold |")
    print("|---|" + "---|" * (len(names) + 1))
    for r in rows:
        hot = sum(r[f"{n}_hot_ms"] for n in summed)
        cold = sum(r[f"{n}_cold_ms"] for n in summed)
        cells = " | ".join(f"{r[f'{n}_hot_ms']:.3f} / {r[f'{n}_cold_ms']:.3f}" for n in names)
        print(f"| {r['k']} | {cells} | {hot:.3f} / {cold:.3f} |")
    for r in rows:
        r["sources_vs_numpy_cold"] = r["sources_cold_ms"] / r["sources_numpy_cold_ms"]
        r["metadata_vs_slots_cold"] = r["metadata_cold_ms"] / r["metadata_slots_cold_ms"]
        print(f"k = {r['k']}: sources cold {r['sources_cold_ms']:.3f} ms, "
              f"{r['sources_vs_numpy_cold']:.2f}x its NumPy baseline ({r['sources_numpy_cold_ms']:.3f} ms); "
              f"metadata cold {r['metadata_cold_ms']:.3f} ms, {r['metadata_vs_slots_cold']:.2f}x a slot per token "
              f"({r['metadata_slots_cold_ms']:.3f} ms)")
        if "sources_per_fact_cold_ms" in r:
            r["sources_vs_per_fact_cold"] = r["sources_cold_ms"] / r["sources_per_fact_cold_ms"]
            print(f"k = {r['k']}: pinned sources cold {r['sources_cold_ms']:.3f} ms, {r['sources_vs_per_fact_cold']:.2f}x "
                  f"a copy per fact ({r['sources_per_fact_cold_ms']:.3f} ms)")
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else host,
              "command": "python " + " ".join(sys.argv), "kv_store": args.kv_store, "python_ref_ms": ref,
              "reps": args.reps, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
