"""Users read from the store of record into the memory tier: users/s against threads.

A load beside the batch whose user the memory tier lacks waits for that user's read
(``inferscale/inject/user_fills.py``), on ``Config.tuning.user_read_threads`` threads. With users
beyond the tier (benchmarks/tier_users.py: 1,000 users, Zipf; a pinned tier of 4 GiB holds ~6 % of
them, the default of a 128 GiB one-GPU machine ~51 %) those reads set how many cold users a
second an engine can take. This writes ``--users``
users of a model's K/V shape (random K/V, ``--facts`` facts of ``--fact-tokens`` tokens, kept in
``--at-rest``) to a disk store, then fills a fresh pinned tier (the same form at rest) with all of
them (``ensure_user``, as a read beside the batch does) for each thread count, ``--repeats``
rounds interleaved, the page cache of the store's files dropped before each fill (``--warm``:
also with it kept). Also one thread with the fp8 NaN check as it was before (every byte masked
and compared: ``--no-before`` leaves it out), in the same rounds.

    python benchmarks/user_reads.py --out benchmarks/results/user_reads_cpu
    python benchmarks/user_reads.py --users 8 --threads 1,2 --repeats 1 --out /tmp/user_reads   # quick check

Prints a table; writes ``<out>.json`` and ``<out>.md``. Users/s is the median over rounds (min-max).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vllm_serve_load as vsl  # noqa: E402
from tier_users import drop_page_cache  # noqa: E402

from inferscale import kv_fp8  # noqa: E402
from inferscale.storage.disk import DiskStore  # noqa: E402
from inferscale.storage.pinned import PinnedHostStore  # noqa: E402
from inferscale.storage.tiers.fill import ensure_user  # noqa: E402


def masked_nan_check(codes: torch.Tensor) -> bool:
    """The fp8 NaN check before kv_fp8.has_nan_code: every byte masked, then compared."""
    return bool(((codes.view(torch.uint8) & 0x7F) == 0x7F).any())


@contextlib.contextmanager
def nan_check(check):
    """kv_fp8's NaN check replaced by ``check`` (None: as it is) for the duration."""
    kept = kv_fp8.has_nan_code
    kv_fp8.has_nan_code = check or kept
    try:
        yield
    finally:
        kv_fp8.has_nan_code = kept


def fill_all(disk: DiskStore, users: list[str], threads: int, at_rest: str) -> float:
    """Seconds to read every user into a fresh pinned tier on ``threads`` threads."""
    memory = PinnedHostStore(PinnedHostStore.Options(device="cpu", max_bytes=None, unbounded=True),
                             kv_dtype_at_rest=at_rest)
    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for loaded in pool.map(lambda user: ensure_user(memory, disk, user), users):
            assert loaded
    return time.perf_counter() - began


def run(args: argparse.Namespace) -> dict:
    data = Path(args.data or tempfile.mkdtemp(prefix="user_reads_"))
    cfg = vsl.SHAPES[args.shape]
    if not (data / "kv").exists():
        vsl.write_users(data, cfg, args.users, args.facts, args.fact_tokens, 32, at_rest=args.at_rest)
    disk = DiskStore(DiskStore.Options(root=str(data / "kv")))
    users = [f"user{u}" for u in range(args.users)]
    user_bytes = statistics.mean(disk.nbytes(u) for u in users)
    systems = [(f"{t} thread{'s' * (t > 1)}", t, None) for t in args.threads]
    if not args.no_before:
        systems.append(("1 thread, NaN check before", 1, masked_nan_check))
    caches = ("cold", "warm") if args.warm else ("cold",)
    seconds: dict[tuple[str, str], list[float]] = {(name, c): [] for name, _, _ in systems for c in caches}
    for round_ in range(args.repeats):
        for name, threads, check in systems:
            for cache in caches:
                if cache == "cold":
                    drop_page_cache(data)
                with nan_check(check):
                    seconds[name, cache].append(fill_all(disk, users, threads, args.at_rest))
        print(f"round {round_ + 1}/{args.repeats} done", flush=True)
    rows = []
    for (name, cache), times in seconds.items():
        rates = [args.users / s for s in times]
        rows.append({"system": name, "page_cache": cache, "users_per_s": statistics.median(rates),
                     "min": min(rates), "max": max(rates),
                     "gb_per_s": statistics.median(rates) * user_bytes / 1e9, "seconds": times})
    if not args.data:
        shutil.rmtree(data, ignore_errors=True)
    return {"command": "python " + shlex.join(sys.argv), "shape": args.shape, "users": args.users,
            "facts": args.facts, "fact_tokens": args.fact_tokens, "at_rest": args.at_rest,
            "user_mb": user_bytes / 1e6, "repeats": args.repeats, "cpus": os.cpu_count(),
            "machine": platform.processor() or platform.machine(), "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"# Users read into the memory tier: {result['shape']} shape, {result['facts']} facts × "
             f"{result['fact_tokens']} tokens a user ({result['user_mb']:.1f} MB, {result['at_rest']} at rest), "
             f"{result['cpus']} CPUs", "", f"`{result['command']}`", "",
             f"{result['users']} users filled into a fresh pinned tier per row, median of {result['repeats']} "
             "interleaved rounds (min-max); cold: the store's files dropped from the page cache first.", "",
             "| system | page cache | users/s | GB/s |", "|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['system']} | {row['page_cache']} | {row['users_per_s']:.1f} "
                     f"({row['min']:.1f}-{row['max']:.1f}) | {row['gb_per_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-7b", choices=sorted(vsl.SHAPES))
    parser.add_argument("--users", type=int, default=40)
    parser.add_argument("--facts", type=int, default=60)
    parser.add_argument("--fact-tokens", type=int, default=20)
    parser.add_argument("--at-rest", default="fp8_e4m3", choices=kv_fp8.AT_REST)
    parser.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warm", action="store_true", help="also fill with the page cache kept")
    parser.add_argument("--no-before", action="store_true", help="leave out the NaN check as it was before")
    parser.add_argument("--data", help="keep the users here (written once, read back by later runs)")
    parser.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    if args.users < 1 or args.repeats < 1 or min(args.threads) < 1:
        parser.error("--users, --repeats and every --threads must be at least 1")
    result = run(args)
    text = markdown(result)
    print(text)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1))
    Path(args.out + ".md").write_text(text)


if __name__ == "__main__":
    main()
