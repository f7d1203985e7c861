"""KV injection against vLLM's own floor, over every saved engine-TTFT run.

The TTFT goal reads KV injection against the question alone. A request with memory also carries
the memory's tokens as context, and vLLM pays for those even when it has them cached: block
hashes, a longer schedule, attention over them. ``ttft.py`` times that floor in every round
(``cached``: the same head served from vLLM's own prefix cache, no connector work at all). This
script gathers, from saved ``ttft.py`` results, the within-round ratios to the question alone of
both, per run, store and k; prints a table and a summary per k, writes JSON and draws them
(PNG) against the goal's line.

    python benchmarks/ttft_floor.py benchmarks/results/ttft_llama8b_h200_run1*.json \
        --out benchmarks/results/ttft_floor_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ttft import HBM_GOAL as GOAL  # noqa: E402


def rows_of(path: Path) -> list[dict]:
    """The rows of one saved run that carry within-round differences and a prefix-cache
    variant (runs without vLLM's prefix cache have no floor to show)."""
    result = json.loads(path.read_text())
    out = []
    for row in result.get("rows", []):
        cached = row.get("cached_minus_none_ms")
        if "kv_vs_none_paired" not in row or cached is None or math.isnan(cached):
            continue
        out.append({"run": path.stem, "kv_store": row["kv_store"], "k": row["k"], "none_ms": row["none_ms"],
                    "kv_vs_none": row["kv_vs_none_paired"], "cached_vs_none": 1 + cached / row["none_ms"],
                    "kv_minus_cached_ms": row["kv_minus_cached_ms"]})
    return out


def summary(rows: list[dict]) -> list[dict]:
    """Per k and store family (hbm, pinned): medians over runs, and how many runs' floor alone
    was already past the goal."""
    out = []
    for k in sorted({r["k"] for r in rows}):
        for family in ("hbm", "pinned"):
            mine = [r for r in rows if r["k"] == k and r["kv_store"].partition(":")[0] == family]
            if not mine:
                continue
            out.append({"k": k, "store": family, "runs": len(mine),
                        "kv_vs_none_median": statistics.median(r["kv_vs_none"] for r in mine),
                        "cached_vs_none_median": statistics.median(r["cached_vs_none"] for r in mine),
                        "kv_minus_cached_ms_median": statistics.median(r["kv_minus_cached_ms"] for r in mine),
                        "floor_past_goal": sum(r["cached_vs_none"] > GOAL for r in mine)})
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({r["k"] for r in rows})
    fig, axes = plt.subplots(1, len(ks), figsize=(4.2 * len(ks), 4), sharey=True, squeeze=False)
    for ax, k in zip(axes[0], ks):
        mine = sorted((r for r in rows if r["k"] == k), key=lambda r: (r["kv_store"], r["run"]))
        xs = range(len(mine))
        ax.scatter(xs, [r["cached_vs_none"] for r in mine], color="0.5", marker="o",
                   label="vLLM's prefix cache (the floor)")
        for family, color in (("hbm", "tab:blue"), ("pinned", "tab:green")):
            picked = [(x, r) for x, r in zip(xs, mine) if r["kv_store"].partition(":")[0] == family]
            ax.scatter([x for x, _ in picked], [r["kv_vs_none"] for _, r in picked], color=color, marker="s",
                       label=f"KV injection ({family})")
        for x, r in zip(xs, mine):
            ax.plot([x, x], [r["cached_vs_none"], r["kv_vs_none"]], color="0.8", zorder=0)
        ax.axhline(GOAL, color="tab:red", linestyle="--", linewidth=1, label=f"hbm goal ({GOAL}×)")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['run'].rsplit('_h200', 1)[-1].lstrip('_') or 'run'} {r['kv_store']}" for r in mine],
                           rotation=70, fontsize=6)
        ax.set_title(f"k = {k}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel("TTFT / question alone\n(within rounds)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="saved ttft.py results (JSON)")
    parser.add_argument("--out", default="benchmarks/results/ttft_floor.json")
    args = parser.parse_args(argv)
    rows = [row for path in args.results for row in rows_of(Path(path))]
    if not rows:
        parser.error("none of these results has within-round rows with vLLM's prefix cache")
    table = summary(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"goal": GOAL, "command": " ".join(["python", *sys.argv]), "rows": rows,
                               "summary": table}, indent=2))
    try:
        plot(rows, out.with_suffix(".png"))
    except ImportError as exc:  # the numbers matter more than the picture
        print(f"no plot ({exc})")
    print("| run | store | k | none ms | prefix cache / none | KV / none | KV − prefix cache ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['kv_store']} | {r['k']} | {r['none_ms']:.2f} | {r['cached_vs_none']:.3f} | "
              f"{r['kv_vs_none']:.3f} | {r['kv_minus_cached_ms']:.2f} |")
    print(f"\n| k | store | runs | prefix cache / none (median) | runs whose prefix cache alone is past {GOAL}× "
          "| KV / none (median) | KV − prefix cache ms (median) |\n|---|---|---|---|---|---|---|")
    for s in table:
        print(f"| {s['k']} | {s['store']} | {s['runs']} | {s['cached_vs_none_median']:.3f} | {s['floor_past_goal']} "
              f"| {s['kv_vs_none_median']:.3f} | {s['kv_minus_cached_ms_median']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
