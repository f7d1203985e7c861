"""Each method's F1 gap to a baseline on the same questions, with a paired bootstrap interval.

    python benchmarks/locomo_gaps.py benchmarks/results/locomo_*_qwen15_h200_answers.json.gz \
        [--baseline 'prompt[closing=answer]'] [--out gaps]

Reads the per-question answers ``locomo_accuracy.py`` writes (``*_answers.json.gz``), one section
per file (each run has its own baseline rows). First, per method, the gap **pooled over k**: each
question's gap averaged over the ks, then bootstrapped over questions — one k on ~1,000 questions
has a ±0.012–0.017 interval, the pooled gap ±0.005–0.008. Then, for every
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


def pooled(category: dict, f1: dict, baseline: str, resamples: int = 2000, seed: int = 0) -> dict:
    """Per method, its gap to ``baseline`` averaged over k question by question, then over the
    questions, with a 95 % paired question-bootstrap interval (all questions, multi-hop, temporal):
    ``{method: {group: {"gap", "low", "high", "questions", "ks"}}}``. A question counts where the
    method and the baseline answered it at every k the method ran."""
    rng = np.random.default_rng(seed)
    by_method: dict = defaultdict(dict)
    for (method, k), answers in f1.items():
        if method != baseline and (baseline, k) in f1:
            by_method[method][k] = answers
    out: dict = {}
    for method, per_k in sorted(by_method.items()):
        ks = sorted(per_k)
        common = set.intersection(*(set(per_k[k]) & set(f1[(baseline, k)]) for k in ks))
        out[method] = {}
        for group, cat in GROUPS.items():
            keys = sorted(q for q in common if cat is None or category[q] == cat)
            if not keys:
                continue
            diffs = np.array([np.mean([per_k[k][q] - f1[(baseline, k)][q] for k in ks]) for q in keys])
            mean, low, high = gap(diffs, resamples, rng)
            out[method][group] = {"gap": mean, "low": low, "high": high, "questions": len(keys), "ks": ks}
    return out


def pooled_markdown(result: dict, baseline: str) -> str:
    """The pooled gaps as a table: one row per method."""
    lines = [f"F1 − `{baseline}`, each question's gap averaged over k, then over questions (95 % paired "
             "bootstrap interval):", "", "| method | ks | " + " | ".join(GROUPS) + " |", "|---|---|" + "---|" * len(GROUPS)]
    for method, groups in result.items():
        ks = next(iter(groups.values()))["ks"] if groups else []
        cells = [f"{g['gap']:+.3f} ({g['low']:+.3f}, {g['high']:+.3f})" if (g := groups.get(name)) else "—"
                 for name in GROUPS]
        lines.append(f"| {method} | {'/'.join(map(str, ks))} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


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
        rows = gaps(category, f1, args.baseline, args.resamples)
        pooled_rows = pooled(category, f1, args.baseline, args.resamples)
        runs[path.name] = {"per_k": rows, "pooled": pooled_rows}
        sections.append(f"## {path.name}\n\n" + pooled_markdown(pooled_rows, args.baseline) + "\n"
                        + markdown(rows, args.baseline))
    text = "# LoCoMo F1 gaps with their intervals\n\n`python benchmarks/locomo_gaps.py " \
        + " ".join(p.name for p in args.answers) + "`\n\n" + "\n".join(sections)
    print(text)
    if args.out:
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"baseline": args.baseline, "resamples": args.resamples,
                                                             "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
