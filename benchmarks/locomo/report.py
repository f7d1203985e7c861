"""What a run writes: the summary per method, k and category, the markdown table, the default's gap
to the baseline with paired bootstrap intervals (:mod:`locomo_gaps`), the answers."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import locomo_gaps

from inferscale.datasets.locomo import CATEGORIES

from .methods import Method
from .questions import Item


def summarize(rows: list[dict], items: list[Item]) -> dict:
    category = {(it.conv, it.index): str(it.category) for it in items}
    groups: dict = defaultdict(lambda: defaultdict(list))
    for r in rows:
        key = (r["method"], r["k"])
        for cat in (category[(r["conv"], r["q"])], "all"):
            groups[key][f"f1.{cat}"].append(r["f1"])
            groups[key][f"contains.{cat}"].append(r["contains"])
        for field in ("injected", "recomputed", "prompt_tokens"):
            groups[key][field].append(r[field])
        groups[key]["fallbacks"].append(r["fallback"] is not None)
    out: dict = defaultdict(dict)
    for (method, k), values in groups.items():
        out[method][str(k)] = {name: sum(v) / len(v) if not name == "fallbacks" else sum(v)
                               for name, v in values.items()}
    return out


def markdown(summary: dict, recall_k: dict, methods: list[Method], ks, n: int, model: str) -> str:
    cats = ["1", "2", "3", "4", "all"]
    names = [CATEGORIES[int(c)] if c != "all" else "all" for c in cats]
    lines = [f"LoCoMo, {n} questions (categories 1–4), {model}: token F1 (containment for all)", "",
             "| method | k | " + " | ".join(names) + " | contains | recomputed tok | injected tok | fallbacks |",
             "|---|---|" + "---|" * (len(cats) + 4)]
    for m in methods:
        for k in ks:
            s = summary.get(m.name, {}).get(str(k))
            if not s:
                continue
            cells = " | ".join(f"{s.get(f'f1.{c}', float('nan')):.3f}" for c in cats)
            lines.append(f"| {m.name} | {k} | {cells} | {s['contains.all']:.3f} | {s['recomputed']:.0f} | "
                         f"{s['injected']:.0f} | {s['fallbacks']} |")
    lines += ["", "Retrieval recall@k of the evidence turns (\"all\": every fact of the conversation):", "",
              "| k | " + " | ".join(names) + " |", "|---|" + "---|" * len(cats)]
    for k, per in recall_k.items():
        lines.append(f"| {k} | " + " | ".join(f"{per.get(c, float('nan')):.3f}" for c in cats) + " |")
    return "\n".join(lines) + "\n"


def gap_table(summary: dict, default: str | None, baseline: str | None, ks) -> str:
    """The default's F1 minus the baseline's, per k: overall, multi-hop and temporal."""
    if not default or not baseline or default not in summary or baseline not in summary:
        return ""
    lines = ["", f"{default} − {baseline} (F1):", "", "| k | all | multi-hop | temporal |", "|---|---|---|---|"]
    for k in ks:
        d, b = summary[default].get(str(k)), summary[baseline].get(str(k))
        if d and b:
            lines.append(f"| {k} | " + " | ".join(f"{d[f'f1.{c}'] - b[f'f1.{c}']:+.3f}" for c in ("all", "1", "2"))
                         + " |")
    return "\n".join(lines) + "\n"


def paired_gaps(rows: list[dict], items: list[Item], baseline: str | None) -> dict:
    """Every method's F1 gap to the baseline (``--baseline``, else prompt injection with the closing
    line), per k and pooled over k, with paired question-bootstrap intervals (:mod:`locomo_gaps`)."""
    baseline = baseline or "prompt[closing=answer]"
    if not any(r["method"] == baseline for r in rows):
        return {}
    category = {(it.conv, it.index): it.category for it in items}
    f1: dict = defaultdict(dict)
    for r in rows:
        f1[(r["method"], r["k"])][(r["conv"], r["q"])] = r["f1"]
    return {"baseline": baseline, "per_k": locomo_gaps.gaps(category, f1, baseline),
            "pooled": locomo_gaps.pooled(category, f1, baseline)}


def write_results(out: Path, meta: dict, timing: dict, rows: list[dict], items: list[Item], methods, ks) -> str:
    """The JSON summary, the markdown table and the answers; rewritten after every method."""
    summary = summarize(rows, items)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = markdown(summary, meta["recall"], methods, ks, len(items), f"{meta['model']} ({meta['dtype']}, "
                     f"{meta['device']})")
    table += gap_table(summary, meta["default"], meta["baseline"], ks)
    gaps = paired_gaps(rows, items, meta["baseline"])
    if gaps:
        table += "\n" + locomo_gaps.pooled_markdown(gaps["pooled"], gaps["baseline"])
    out.write_text(json.dumps({**meta, "run_s": timing, "summary": summary, "gaps": gaps}, indent=1))
    out.with_suffix(".md").write_text(table)
    with gzip.open(out.with_name(out.stem + "_answers.json.gz"), "wt") as fh:
        json.dump({"questions": [asdict(it) for it in items], "rows": rows}, fh)
    return table
