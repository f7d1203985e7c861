"""One retrieval table per data set from ``retrieval_latency.py`` results, and the default per size.

    python benchmarks/retrieval_table.py /tmp/run/retrieval_*.json --out benchmarks/results/retrieval_h200

Rows from several files of the same data are merged (a file named ``*_jasper192.json`` holds a
Jasper built with construct beam L = 192, ``*_jasper64.json`` the shipped L = 64: the backend's
name says so). For each size the **default** is the backend with the lowest single-query p50 among
those reaching recall@50 ≥ ``--recall`` (0.95); exact search reaches 1.0, so it is the default
unless an index is both good enough and faster. Writes ``<out>.md``, ``<out>.json`` and
``<out>.png`` (recall@k against single-query p50, one panel per data set and size).
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


def plot(sets: dict[str, dict], floor: float, path: Path) -> None:
    """Recall@k against single-query p50 latency (log scale), one panel per data set and size; the
    recall floor dashed, each backend family one colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, n) for name, data in sets.items() for n in sorted({r["n"] for r in data["rows"]})]
    if not panels:
        return
    cols = min(3, len(panels))
    rows_ = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(5.5 * cols, 4.2 * rows_), squeeze=False)
    families = sorted({r["backend"].split(":")[0].split("[")[0] for d in sets.values() for r in d["rows"]})
    colour = {f: f"C{i % 10}" for i, f in enumerate(families)}
    for ax, (name, n) in zip(axes.flat, panels):
        data = sets[name]
        k = data["k"]
        for r in (r for r in data["rows"] if r["n"] == n):
            family = r["backend"].split(":")[0].split("[")[0]
            ax.scatter(r["p50_ms"], r[f"recall_at_{k}"], color=colour[family], s=28)
            ax.annotate(r["backend"], (r["p50_ms"], r[f"recall_at_{k}"]), fontsize=6, xytext=(3, 2),
                        textcoords="offset points")
        ax.axhline(floor, linestyle="--", color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_ylim(-0.02, 1.05)
        ax.set_title(f"{name}, {n:,} facts", fontsize=9)
        ax.set_xlabel("single query p50 (ms, log)")
        ax.set_ylabel(f"recall@{k}")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    plot(sets, args.recall, args.out.with_suffix(".png"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
