"""Plot LoCoMo F1 against cost, for every method and k, from a locomo_accuracy.py result.

Left: F1 against the tokens vLLM prefills per request (the recomputed memory tokens plus the
question part, measured in the accuracy run itself), every method at every k. Right: F1 against
the engine TTFT that ``benchmarks/ttft.py`` measured for the same k and recompute budget
(Llama-3.1-8B shape, H200), for the methods and k it timed.

    python benchmarks/plot_locomo.py benchmarks/results/locomo_qwen05_h200.json \\
        --ttft benchmarks/results/ttft_budget_h200.json --out benchmarks/results/locomo_qwen05_h200.png
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

HIGHLIGHT = {"prompt": "black", "kv": "tab:red", "kv[window=-5]": "tab:green",
             "kv[window=-5,recompute_tokens=256]": "tab:blue",
             "kv[window=-5,closing=answer,recompute_tokens=256]": "tab:purple",
             "prompt[closing=answer]": "tab:gray"}


def prefilled_tokens(result_path: Path) -> dict[tuple[str, int], float]:
    """(method, k) → mean tokens vLLM prefilled per request (prompt minus injected)."""
    answers = result_path.with_name(result_path.stem + "_answers.json.gz")
    with gzip.open(answers, "rt") as fh:
        rows = json.load(fh)["rows"]
    sums: dict = defaultdict(lambda: [0.0, 0])
    for r in rows:
        cell = sums[(r["method"], r["k"])]
        cell[0] += r["prompt_tokens"] - r["injected"]
        cell[1] += 1
    return {key: total / n for key, (total, n) in sums.items()}


def ttft_lookup(path: Path | None) -> dict[tuple[int, int | None], float]:
    """(k, recompute budget or None for prompt injection) → median TTFT ms."""
    if not path:
        return {}
    rows = json.loads(path.read_text())["rows"]
    out = {(r["k"], r["recompute_tokens"]): r["kv_ms"] for r in rows}
    out.update({(r["k"], None): r["prompt_ms"] for r in rows})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result")
    parser.add_argument("--ttft", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(args.result)
    result = json.loads(path.read_text())
    summary, methods = result["summary"], {m["name"]: m for m in result["methods"]}
    tokens = prefilled_tokens(path)
    ttft = ttft_lookup(Path(args.ttft) if args.ttft else None)
    fig, axes = plt.subplots(1, 2 if ttft else 1, figsize=(15 if ttft else 8, 6), squeeze=False)
    left, right = axes[0][0], axes[0][1] if ttft else None
    for name, per_k in summary.items():
        color = HIGHLIGHT.get(name, "lightgray")
        ks = sorted(int(k) for k in per_k)
        f1 = [per_k[str(k)]["f1.all"] for k in ks]
        label = name if name in HIGHLIGHT else None
        left.plot([tokens[(name, k)] for k in ks], f1, "o-", color=color, label=label, ms=4,
                  zorder=3 if label else 1)
        if right is not None:
            budget = None if methods[name]["mode"] == "prompt" else methods[name]["recompute_tokens"]
            timed = [k for k in ks if (k, budget) in ttft]
            if timed:
                right.plot([ttft[(k, budget)] for k in timed], [per_k[str(k)]["f1.all"] for k in timed], "o-",
                           color=color, label=label, ms=4, zorder=3 if label else 1)
    for name in ("prompt", "kv[window=-5,recompute_tokens=256]"):
        for k, cell in summary.get(name, {}).items():
            left.annotate(f"k={k}", (tokens[(name, int(k))], cell["f1.all"]), fontsize=7,
                          textcoords="offset points", xytext=(4, 4))
    left.set(xscale="log", xlabel="tokens prefilled per request (mean)", ylabel="token F1 (all categories)",
             title=f"LoCoMo, {result['questions']} questions, {result['model']}")
    left.grid(alpha=0.3)
    left.legend(fontsize=7, loc="lower right")
    if right is not None:
        right.set(xlabel="engine TTFT, ms (Llama-3.1-8B shape, H200, k = 10 and 50)", ylabel="token F1 (all)",
                  title="F1 against the TTFT of the same k and recompute budget")
        right.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(args.out or path.with_suffix(".png"))
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main()
