"""Time ``KVStore.get`` of k facts for each store, against the raw transfer floor.

Default shape is Llama-3-8B's K/V (32 layers, 8 kv heads, head size 128,
bf16) with 50 tokens per fact. On a CUDA machine ``get`` targets the GPU and
the floor is one pinned host-to-device copy of the same number of bytes; the
table reports get/floor. On a CPU-only machine everything stays on the CPU
and there is no floor.

    python benchmarks/kv_store_get.py                 # full size
    python benchmarks/kv_store_get.py --layers 4      # quick check

Writes ``benchmarks/results/kv_store_get_<device>.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script from a checkout: import the checkout's inferscale
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferscale.config import BackendSpec, build  # noqa: E402
from inferscale.kv import FactKV  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="kv heads")
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--tokens", type=int, default=50, help="tokens per fact")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--facts", type=int, default=64, help="facts stored for the user (>= max k)")
    p.add_argument("--ks", default="1,10,50", help="comma-separated numbers of facts per get")
    p.add_argument("--stores", default="hbm,pinned,disk")
    p.add_argument("--reps", type=int, default=20, help="timed gets per (store, k); disk uses at most 3")
    p.add_argument("--root", default=None, help="disk store directory (default: a temp dir)")
    p.add_argument("--out", default=None, help="JSON path (default: results/kv_store_get_<device>.json)")
    return p.parse_args(argv)


def device_slug(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> list[float]:
    """Wall time of each call, device work included (synchronised before and after)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def make_facts(args: argparse.Namespace) -> dict[str, FactKV]:
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    shape = (args.layers, args.tokens, args.heads, args.head_size)
    facts = {}
    for i in range(args.facts):
        keys = torch.randn(shape, generator=gen).to(dtype)
        values = torch.randn(shape, generator=gen).to(dtype)
        facts[f"fact-{i:04d}"] = FactKV(range(i * args.tokens, (i + 1) * args.tokens), keys, values)
    return facts


def arithmetic(args: argparse.Namespace, ks: list[int]) -> dict:
    itemsize = getattr(torch, args.dtype).itemsize
    per_token = 2 * args.layers * args.heads * args.head_size * itemsize
    per_fact = per_token * args.tokens
    print(
        f"K+V per token = 2 x {args.layers} layers x {args.heads} heads x {args.head_size} x {itemsize} B "
        f"= {per_token:,} B; per fact ({args.tokens} tokens) = {per_fact / 1e6:.2f} MB"
    )
    for k in ks:
        print(f"  k={k:>3}: {k * per_fact:,} B = {k * per_fact / 1e6:.1f} MB ({k * per_fact / 2**20:.1f} MiB)")
    return {"bytes_per_token": per_token, "bytes_per_fact": per_fact}


def floor_ms(nbytes: int, device: torch.device, reps: int) -> float | None:
    """Median time of one pinned host-to-device copy of ``nbytes`` (None without CUDA)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.random_(0, 255)
    return statistics.median(time_ms(lambda: src.to(device, non_blocking=True), device, reps))


def bench_store(name: str, store, facts, ks, per_fact, floors, device, args) -> list[dict]:
    store.put("bench-user", facts)
    ids = list(facts)
    rng = random.Random(1)
    reps = min(args.reps, 3) if name == "disk" else args.reps
    rows = []
    for k in ks:
        picks = [rng.sample(ids, k) for _ in range(reps + 2)]
        it = iter(picks)
        times = time_ms(lambda: store.get("bench-user", next(it), device), device, reps)
        median, nbytes = statistics.median(times), k * per_fact
        floor = floors.get(k)
        rows.append(
            {
                "store": name,
                "k": k,
                "bytes": nbytes,
                "median_ms": median,
                "min_ms": min(times),
                "gb_per_s": nbytes / median / 1e6,
                "floor_ms": floor,
                "ratio_to_floor": None if floor is None else median / floor,
                "reps": reps,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'store':<8}{'k':>4}{'MB':>9}{'median ms':>11}{'min ms':>9}{'GB/s':>8}{'floor ms':>10}{'ratio':>10}")
    for r in rows:
        floor = "-" if r["floor_ms"] is None else f"{r['floor_ms']:.3f}"
        ratio = "-" if r["ratio_to_floor"] is None else f"{r['ratio_to_floor']:.2f}x"
        print(
            f"{r['store']:<8}{r['k']:>4}{r['bytes'] / 1e6:>9.1f}{r['median_ms']:>11.3f}{r['min_ms']:>9.3f}"
            f"{r['gb_per_s']:>8.2f}{floor:>10}{ratio:>10}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    if max(ks) > args.facts:
        sys.exit(f"--facts {args.facts} is less than the largest k {max(ks)}")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    print(f"device: {device} ({device_slug(device)}), torch {torch.__version__}, threads {torch.get_num_threads()}")
    sizes = arithmetic(args, ks)
    facts = make_facts(args)
    floors = {k: floor_ms(k * sizes["bytes_per_fact"], device, args.reps) for k in ks}
    floors = {k: v for k, v in floors.items() if v is not None}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.stores.split(","):
            options = {"root": args.root or tmp} if name == "disk" else {}
            store = build("kv_store", BackendSpec(name, options), device=str(device))
            rows += bench_store(name, store, facts, ks, sizes["bytes_per_fact"], floors, device, args)
            del store
    print_table(rows)
    out = Path(args.out) if args.out else RESULTS / f"kv_store_get_{device_slug(device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    shape = {k: getattr(args, k) for k in ("layers", "heads", "head_size", "tokens", "dtype", "facts")}
    report = {
        "device": device_slug(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shape": shape,
        **sizes,
        "rows": rows,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
