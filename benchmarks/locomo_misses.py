"""Where KV injection loses to prompt injection: the F1 gap by what the retrieved evidence looks like.

    python benchmarks/locomo_misses.py benchmarks/results/locomo_context_qwen15_h200_answers.json.gz \
        --data ../shared/data/locomo --k 50 [--category 1] [--out misses]

For each question of a category (1, multi-hop, by default) the retrieved top-k facts are sorted
by what their evidence needs, from the LoCoMo data: the facts that cite one of the question's
evidence turns are its *evidence facts*, and the groups are

* ``none``: no evidence fact was retrieved (both methods answer from other facts);
* ``one``: one evidence fact retrieved (nothing to combine);
* ``near``: several, each one within the facts window of another in stored order (its encoding
  saw the other: the window holds the facts stored before it);
* ``apart``: several, some not within a window of any other (no encoding saw them together:
  only the query, and a recomputed tail, can combine them).

The window is each method's own (``window=-10`` → 10; 5 when the name gives none). Each group's gap
(method − baseline F1 on the same questions) comes with its 95 % paired bootstrap interval
(``locomo_gaps.py``). If the loss sits in ``apart``, encodings that see co-retrieved facts are the
remedy; if it sits in ``one`` or ``none`` as much, what the facts' K/V say alone differs.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from locomo_gaps import gap  # noqa: E402

GROUP_NAMES = ("none", "one", "near", "apart")


def evidence_facts(conv, evidence: list[str]) -> set[int]:
    """Indices (in ``conv.all_facts()`` order) of the facts citing one of the evidence turns."""
    wanted = set(evidence)
    cited = conv.cited or {}
    return {j for j, (text, source) in enumerate(conv.all_facts())
            if wanted & set(cited.get(text, (source,)))}


def group_of(found: list[int], window: int) -> str:
    """The group of a question whose retrieved evidence facts are ``found`` (stored indices)."""
    if not found:
        return "none"
    if len(found) == 1:
        return "one"
    seen_together = all(any(0 < abs(a - b) <= window for b in found if b != a) for a in found)
    return "near" if seen_together else "apart"


def window_of(method: str) -> int:
    match = re.search(r"window=-(\d+)", method)
    return int(match.group(1)) if match else 5


def misses(answers: dict, convs: dict, k: int, category: int, baseline: str, resamples: int = 2000) -> list[dict]:
    f1: dict = defaultdict(dict)
    for row in answers["rows"]:
        if row["k"] == k:
            f1[row["method"]][(row["conv"], row["q"])] = row["f1"]
    base = f1.get(baseline)
    if base is None:
        raise SystemExit(f"no {baseline!r} rows at k = {k}")
    questions = [q for q in answers["questions"] if q["category"] == category]
    evidence = {(q["conv"], q["index"]): sorted(evidence_facts(convs[q["conv"]], q["evidence"])
                                               & set(q["retrieved"][:k])) for q in questions}
    rng = np.random.default_rng(0)
    rows = []
    for method in sorted(m for m in f1 if m != baseline):
        window = window_of(method)
        groups: dict[str, list] = defaultdict(list)
        for key, found in evidence.items():
            if key in f1[method] and key in base:
                groups[group_of(found, window)].append(f1[method][key] - base[key])
        for name in GROUP_NAMES:
            diffs = np.array(groups.get(name, []))
            if len(diffs) == 0:
                continue
            mean, low, high = gap(diffs, resamples, rng)
            rows.append({"method": method, "group": name, "questions": len(diffs), "gap": mean, "low": low,
                         "high": high, "share_of_loss": float(diffs.sum())})
    return rows


def table(rows: list[dict], k: int) -> list[str]:
    lines = [f"| method | group | questions | gap at k = {k} (95 %) | summed gap |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['group']} | {r['questions']} | {r['gap']:+.3f} ({r['low']:+.3f}, "
                     f"{r['high']:+.3f}) | {r['share_of_loss']:+.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    from inferscale.datasets.locomo import load_all

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("answers", nargs="+", type=Path, help="locomo_accuracy.py's *_answers.json.gz")
    p.add_argument("--data", type=Path, required=True, help="the LoCoMo conversations (../shared/data/locomo)")
    p.add_argument("--k", type=int, nargs="+", default=[50])
    p.add_argument("--category", type=int, default=1, help="LoCoMo QA category (1 multi-hop, 2 temporal)")
    p.add_argument("--baseline", default="prompt[closing=answer]")
    p.add_argument("--out", type=Path, default=None, help="path without suffix: writes .md and .json")
    args = p.parse_args(argv)
    convs = {c.sample_id: c for c in load_all(args.data)}
    lines = ["# Where KV injection loses: the gap by retrieved evidence", "",
             f"`python benchmarks/locomo_misses.py {' '.join(a.name for a in args.answers)} --k "
             f"{' '.join(map(str, args.k))} --category {args.category}`; groups as in the script's docstring.", ""]
    everything = {}
    for path in args.answers:
        answers = json.loads(gzip.open(path).read())
        for k in args.k:
            rows = misses(answers, convs, k, args.category, args.baseline)
            everything[f"{path.name}@{k}"] = rows
            lines += [f"## {path.name}, k = {k}", "", *table(rows, k), ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.with_suffix(".md").write_text(text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(everything, indent=1) + "\n")


if __name__ == "__main__":
    main()
