"""One retrieval table per data set from ``retrieval_latency.py`` results, and the default per size.

    python benchmarks/retrieval_table.py /tmp/run/retrieval_*.json --out benchmarks/results/retrieval_h200

Rows from several files of the same data are merged (a file named ``*_jasper192.json`` holds a
Jasper built with construct beam L = 192, ``*_jasper64.json`` the shipped L = 64: the backend's
name says so). For each size the **default** is the backend with the lowest single-query p50 among
those reaching recall@50 ≥ ``--recall`` (0.95); exact search reaches 1.0, so it is the default
unless an index is both good enough and faster. Writes ``<out>.md`` and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def label(backend: str, path: Path) -> str:
    """The backend's name, with the Jasper build a file holds (``jasper[L=192]:beam=512``)."""
    build = re.search(r"_jasper(\d+)\.json$", path.name)
    if build and backend.startswith("jasper"):
        base, _, rest = backend.partition(":")
        return f"{base}[L={build.group(1)}]" + (f":{rest}" if rest else "")
    return backend


def load(paths: list[Path]) -> dict[str, dict]:
    """data name → {"command": [...], "difficulty": {n: {...}}, "rows": [...]}, rows labelled."""
    sets: dict[str, dict] = {}
    for path in paths:
        result = json.loads(path.read_text())
        data = sets.setdefault(result["data"], {"commands": [], "difficulty": {}, "rows": [], "failures": [],
                                                "k": result["k"]})
        data["failures"] += [{**f, "backend": label(f["backend"], path)} for f in result.get("failures", [])]
        data["commands"].append(result["command"])
        for d in result.get("difficulty", []):
            data["difficulty"][d["n"]] = d
        for row in result["rows"]:
            data["rows"].append({**row, "backend": label(row["backend"], path)})
    return sets


def default_for(rows: list[dict], k: int, floor: float) -> dict | None:
    """The fastest single query (p50) among rows with recall@k ≥ floor."""
    good = [r for r in rows if r.get(f"recall_at_{k}", 0.0) >= floor]
    return min(good, key=lambda r: r["p50_ms"]) if good else None


def table(name: str, data: dict, floor: float) -> tuple[list[str], dict]:
    k = data["k"]
    lines = [f"## {name}", ""]
    picks = {}
    for n in sorted({r["n"] for r in data["rows"]}):
        rows = sorted((r for r in data["rows"] if r["n"] == n), key=lambda r: r["p50_ms"])
        d = data["difficulty"].get(n)
        hard = (f": LID {d['lid_median']:.1f} (10-90 %: {d['lid_p10']:.1f}-{d['lid_p90']:.1f}), relative contrast "
                f"at {k} {d[f'contrast_at_{k}_median']:.3f}") if d else ""
        pick = default_for(rows, k, floor)
        picks[n] = pick["backend"] if pick else None
        lines += [f"**{n:,} facts**{hard}. Default: **{picks[n] or 'none reaches the recall floor'}**.", "",
                  f"| backend | recall@10 | recall@{k} | p50 ms | p99 ms | batch 64 p50 ms | batch 64 p99 ms "
                  "| build s | GPU MiB | host MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            gpu = "—" if r.get("gpu_mib") is None else f"{r['gpu_mib']:.0f}"
            lines.append(f"| {r['backend']} | {r['recall_at_10']:.3f} | {r[f'recall_at_{k}']:.3f} | {r['p50_ms']:.3f} "
                         f"| {r['p99_ms']:.3f} | {r['batch_p50_ms']:.2f} | {r['batch_p99_ms']:.2f} | {r['build_s']:.2f} "
                         f"| {gpu} | {r['host_mib']:.0f} |")
        lines.append("")
    if data["failures"]:
        lines += ["Failed (no row):", "", *(f"- {f['backend']} at {f['n']:,}: {f['error']}" for f in data["failures"]), ""]
    lines += ["Commands:", "", *(f"    {c}" for c in data["commands"]), ""]
    return lines, picks


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--recall", type=float, default=0.95, help="recall@k a default must reach")
    p.add_argument("--out", type=Path, required=True, help="path without suffix: writes .md and .json")
    args = p.parse_args(argv)
    sets = load(args.results)
    lines = ["# Retrieval: recall, latency, build and memory", "",
             f"Default per size: the fastest single query (p50) with recall@k ≥ {args.recall}. "
             "Latencies are one query at a time and batches of 64; memory is what the build added.", ""]
    defaults = {}
    for name, data in sets.items():
        block, picks = table(name, data, args.recall)
        lines += block
        defaults[name] = picks
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines))
    args.out.with_suffix(".json").write_text(json.dumps({"recall_floor": args.recall, "defaults": defaults,
                                                         "sets": sets}, indent=1, default=str) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
