"""Each method's F1 gap to a baseline on the same questions, with a paired bootstrap interval.

    python benchmarks/locomo_gaps.py benchmarks/results/locomo_*_qwen15_h200_answers.json.gz \
        [--baseline 'prompt[closing=answer]'] [--out gaps]

Reads the per-question answers ``locomo_accuracy.py`` writes (``*_answers.json.gz``), one section
per file (each run has its own baseline rows). For every
method, k and question group (all questions, multi-hop, temporal), the gap is the mean over the
group's questions of (method F1 − baseline F1), both answering the same question from the same
retrieved facts; its 95 % interval resamples the questions (seeded, 2,000 resamples). A gap whose
interval lies wholly above a goal (e.g. −0.02) meets it whatever the sample of questions; one whose
interval holds the goal is undecided at this many questions.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

#: LoCoMo's QA categories the goals name (1: multi-hop, 2: temporal), and every question
GROUPS = {"all": None, "multi-hop": 1, "temporal": 2}


def load(path: Path) -> tuple[dict, dict]:
    data = json.loads(gzip.open(path).read())
    category = {(q["conv"], q["index"]): q["category"] for q in data["questions"]}
    f1: dict = defaultdict(dict)
    for row in data["rows"]:
        f1[(row["method"], row["k"])][(row["conv"], row["q"])] = row["f1"]
    return category, f1


def gap(diffs: np.ndarray, resamples: int, rng: np.random.Generator) -> tuple[float, float, float]:
    """Mean of the paired differences and its 95 % bootstrap interval."""
    means = diffs[rng.integers(0, len(diffs), size=(resamples, len(diffs)))].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return float(diffs.mean()), float(low), float(high)


def gaps(category: dict, f1: dict, baseline: str, resamples: int = 2000, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for (method, k), answers in sorted(f1.items()):
        base = f1.get((baseline, k))
        if method == baseline or base is None:
            continue
        for group, cat in GROUPS.items():
            keys = [q for q in base if q in answers and (cat is None or category[q] == cat)]
            diffs = np.array([answers[q] - base[q] for q in keys])
            mean, low, high = gap(diffs, resamples, rng)
            rows.append({"method": method, "k": k, "group": group, "questions": len(keys),
                         "gap": mean, "low": low, "high": high})
    return rows


def markdown(rows: list[dict], baseline: str) -> str:
    cells: dict = defaultdict(dict)
    for r in rows:
        cells[(r["method"], r["k"])][r["group"]] = f"{r['gap']:+.3f} ({r['low']:+.3f}, {r['high']:+.3f})"
    counts = {r["group"]: r["questions"] for r in rows}
    head = " | ".join(f"{g} ({counts.get(g, 0)} q)" for g in GROUPS)
    lines = [f"F1 − `{baseline}`, mean over questions (95 % paired bootstrap interval):", "",
             f"| method | k | {head} |", "|---|---|" + "---|" * len(GROUPS)]
    for (method, k), by_group in cells.items():
        lines.append(f"| {method} | {k} | " + " | ".join(by_group.get(g, "—") for g in GROUPS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("answers", type=Path, nargs="+", help="locomo_accuracy.py *_answers.json.gz files")
    parser.add_argument("--baseline", default="prompt[closing=answer]")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None, help="path without suffix: OUT.md and OUT.json")
    args = parser.parse_args(argv)
    sections, runs = [], {}
    for path in args.answers:
        category, f1 = load(path)
        if not any(method == args.baseline for method, _ in f1):
            raise SystemExit(f"no method {args.baseline!r} in {path}; methods: {sorted({m for m, _ in f1})}")
        runs[path.name] = rows = gaps(category, f1, args.baseline, args.resamples)
        sections.append(f"## {path.name}\n\n" + markdown(rows, args.baseline))
    text = "# LoCoMo F1 gaps with their intervals\n\n`python benchmarks/locomo_gaps.py " \
        + " ".join(p.name for p in args.answers) + "`\n\n" + "\n".join(sections)
    print(text)
    if args.out:
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"baseline": args.baseline, "resamples": args.resamples,
                                                             "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
