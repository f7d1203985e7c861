"""The disk store's two hot paths, before (commit 2de794e, format 2) and after (format 3), in one run.

* **planner, cold user**: the scheduler's first ``plan_request`` for a user whose file
  is large (default: Llama-3-8B K/V shape, 150 facts × 50 tokens ≈ 983 MB), with a
  fresh store (no cached index), k = 10 facts. Also the planner process's peak RSS growth.
* **fact add at 1,000 facts**: adding one fact (K/V, record, embedding) to a user who
  has 1,000 (default: Qwen2.5-0.5B K/V shape, bf16, 16 tokens a fact ≈ 197 MB).

Each side runs in its own processes with its own code on ``PYTHONPATH`` (the
"before" tree is ``git archive`` of the commit), writes its own native files,
and is timed the same way. The page cache is warm for both (files were just
written). Prints a table and writes ``benchmarks/results/disk_store_cpu.json``.

    python benchmarks/disk_store.py                      # full size (≈ 2 GB of temp files)
    python benchmarks/disk_store.py --plan-facts 10 --add-facts 50 --reps 2   # quick check
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BEFORE = "2de794e"
#: (layers, kv heads, head size) of the K/V shapes used
SHAPES = {"llama-3-8b": (32, 8, 128), "qwen2.5-0.5b": (24, 2, 64)}
PREFIX_TOKENS = 40
QUESTION_TOKENS = 12
EMBEDDING_DIM = 384


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan-shape", default="llama-3-8b", choices=sorted(SHAPES))
    p.add_argument("--plan-facts", type=int, default=150, help="facts in the large user's file")
    p.add_argument("--plan-tokens", type=int, default=50, help="tokens per fact (planner)")
    p.add_argument("--add-shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--add-facts", type=int, default=1000, help="facts stored before the timed adds")
    p.add_argument("--add-tokens", type=int, default=16, help="tokens per fact (adds)")
    p.add_argument("--reps", type=int, default=10, help="timed plans / adds per side")
    p.add_argument("--before", default=BEFORE, help="the commit measured as 'before' ('none': skip)")
    p.add_argument("--root", default=None, help="work directory (default: a temp dir, removed after)")
    p.add_argument("--out", default=str(RESULTS / "disk_store_cpu.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- workers (run under one tree's code)


def fact_kv(shape: str, tokens: int, seed: int):
    import torch

    from inferscale.kv import FactKV

    layers, heads, size = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 30000, (tokens,), generator=gen).tolist()
    kv = torch.randn((2, layers, tokens, heads, size), generator=gen).to(torch.bfloat16)
    return FactKV(ids, kv[0], kv[1])


def store(data: Path):
    from inferscale.storage.disk import DiskStore

    return DiskStore(DiskStore.Options(root=str(data / "kv")))


def write_user(args, data: Path, shape: str, facts: int, tokens: int, with_records: bool) -> None:
    """The system prefix and user ``bench`` with ``facts`` facts, written in one put."""
    import torch

    from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER
    from inferscale.facts import Fact

    disk = store(data)
    disk.put(SYSTEM_USER, {PREFIX_FACT: fact_kv(shape, PREFIX_TOKENS, 0)})
    kvs = {f"f{i}": fact_kv(shape, tokens, i + 1) for i in range(facts)}
    if not with_records:
        disk.put("bench", kvs)
        return
    records = {f: Fact(f, "bench", f"Fact number {f}.", "D1:1") for f in kvs}
    disk.put("bench", kvs, records, {f: torch.randn(EMBEDDING_DIM) for f in kvs})


def worker_plan_setup(args, data: Path) -> dict:
    write_user(args, data, args.plan_shape, args.plan_facts, args.plan_tokens, with_records=False)
    return {"file_bytes": sum(p.stat().st_size for p in (data / "kv").rglob("*") if p.is_file())}


def planner_call(data: Path):
    """A function running one cold plan (new store, nothing cached) of k = 10 facts."""
    import inspect

    from inferscale.compose.blend import Blend
    from inferscale.compose.request import make_params

    try:
        from inferscale.inject.planner import plan_request
    except ImportError:  # a tree from before the write path moved out of connector/
        from inferscale.connector.planner import plan_request

    request = json.loads((data / "request.json").read_text())
    params = make_params("bench", request["fact_ids"])
    keyed = "salts" in inspect.signature(plan_request).parameters
    if keyed:
        from inferscale.compose.salt import CacheSalts

        salts = CacheSalts(b"benchmark-secret-0123456789abcdef")
        salt = salts.segment("bench", store(data).epoch("bench"), request["segment"])
        return lambda: plan_request(store(data), salts, request["prompt"], params, salt, 0, Blend())
    from inferscale.compose.request import segment_salt

    salt = segment_salt("bench", request["segment"])
    return lambda: plan_request(store(data), request["prompt"], params, salt, 0, Blend())


def worker_plan(args, data: Path) -> dict:
    plan = planner_call(data)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        result = plan()
        times.append((time.perf_counter() - start) * 1e3)
        assert result.fallback is None and result.num_external > 0, (result.fallback, result.detail)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    return {"ms": times, "rss_growth_mb": grown / 1024}


def worker_add(args, data: Path) -> dict:
    import torch

    from inferscale.facts import Fact

    write_user(args, data, args.add_shape, args.add_facts, args.add_tokens, with_records=True)
    disk = store(data)
    times = []
    for i in range(args.reps):
        fact_id = f"new{i}"
        kv = fact_kv(args.add_shape, args.add_tokens, 10_000 + i)
        record = {fact_id: Fact(fact_id, "bench", f"New fact {i}.", "D2:1")}
        start = time.perf_counter()
        disk.put("bench", {fact_id: kv}, record, {fact_id: torch.randn(EMBEDDING_DIM)})
        times.append((time.perf_counter() - start) * 1e3)
    assert len(disk.list("bench")) == args.add_facts + args.reps
    return {"ms": times, "user_bytes": disk.nbytes("bench")}


def write_request(args, data: Path) -> None:
    """The planner's request (k = 10 facts, the segment's token ids, the prompt), from the
    same seeds the files were written with (so no file is read to build it)."""
    k = min(10, args.plan_facts)
    fact_ids = [f"f{i}" for i in range(args.plan_facts - k, args.plan_facts)]
    segment = list(fact_kv(args.plan_shape, PREFIX_TOKENS, 0).token_ids)
    for i in range(args.plan_facts - k, args.plan_facts):
        segment += fact_kv(args.plan_shape, args.plan_tokens, i + 1).token_ids
    prompt = segment + list(range(1, QUESTION_TOKENS + 1))
    (data / "request.json").write_text(json.dumps({"fact_ids": fact_ids, "segment": segment, "prompt": prompt}))


WORKERS = {"plan-setup": worker_plan_setup, "plan": worker_plan, "add": worker_add}


def run_worker(args) -> None:
    data = Path(args.data)
    if args.worker == "plan-setup":
        write_request(args, data)
    print(json.dumps(WORKERS[args.worker](args, data)))


# ---------------------------------------------------------------- orchestration


def before_tree(commit: str, work: Path) -> Path:
    tree = work / f"tree-{commit}"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "inferscale"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def call(tree: Path, worker: str, data: Path, argv: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", worker, "--data", str(data), *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(data))
    if proc.returncode != 0:
        raise RuntimeError(f"{worker} under {tree} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(tree: Path, work: Path, label: str, argv: list[str]) -> dict:
    plan_data, add_data = work / f"{label}-plan", work / f"{label}-add"
    plan_data.mkdir()
    add_data.mkdir()
    setup = call(tree, "plan-setup", plan_data, argv)
    plan = call(tree, "plan", plan_data, argv)
    shutil.rmtree(plan_data)
    add = call(tree, "add", add_data, argv)
    shutil.rmtree(add_data)
    return {"file_bytes": setup["file_bytes"], "plan": plan, "add": add}


def summary(ms: list[float]) -> dict:
    return {"median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms), "max_ms": max(ms)}


def table(result: dict) -> str:
    sides = [s for s in ("before", "after") if s in result["sides"]]
    lines = [f"{'':38s}" + "".join(f"{s:>14s}" for s in sides) + ("       ratio" if len(sides) == 2 else "")]

    def row(name: str, values: list[float], unit: str) -> None:
        ratio = f"{values[0] / values[1]:11.1f}×" if len(values) == 2 and values[1] else ""
        lines.append(f"{name:38s}" + "".join(f"{v:11.1f} {unit:2s}" for v in values) + ratio)

    adds = f"fact add at {result['add']['facts']:,} facts (median)"
    for key, name in (("plan", "planner, cold user (median)"), ("add", adds)):
        row(name, [result["sides"][s][key]["median_ms"] for s in sides], "ms")
        row(name.replace("median", "mean"), [result["sides"][s][key]["mean_ms"] for s in sides], "ms")
    row("planner peak RSS growth", [result["sides"][s]["plan_rss_growth_mb"] for s in sides], "MB")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    forwarded = list(argv if argv is not None else sys.argv[1:])
    work = Path(args.root or tempfile.mkdtemp(prefix="inferscale-disk-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        trees = {"after": REPO} if args.before == "none" else {"before": before_tree(args.before, work), "after": REPO}
        sides = {}
        for label, tree in trees.items():
            raw = measure(tree, work, label, forwarded)
            sides[label] = {"plan": summary(raw["plan"]["ms"]), "add": summary(raw["add"]["ms"]),
                            "plan_rss_growth_mb": raw["plan"]["rss_growth_mb"], "plan_file_bytes": raw["file_bytes"],
                            "add_user_bytes": raw["add"]["user_bytes"], "raw": raw}
    finally:
        if args.root is None:
            shutil.rmtree(work, ignore_errors=True)
    result = {"command": " ".join(["python", "benchmarks/disk_store.py", *forwarded]), "before": args.before,
              "plan": {"shape": args.plan_shape, "facts": args.plan_facts, "tokens_per_fact": args.plan_tokens,
                       "k": min(10, args.plan_facts)},
              "add": {"shape": args.add_shape, "facts": args.add_facts, "tokens_per_fact": args.add_tokens},
              "reps": args.reps, "sides": sides}
    if len(sides) == 2:
        result["ratios"] = {key: sides["before"][key]["median_ms"] / sides["after"][key]["median_ms"]
                            for key in ("plan", "add")}
    print(table(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
