"""Accuracy against throughput: every LoCoMo method as a point (F1, requests/s under load).

Joins a ``locomo_accuracy.py`` result with a ``vllm_serve_load.py`` result: a method's throughput
is that of the load run's system that spends what the method spends per request — ``prompt`` for
prompt injection, ``kv@B`` for KV injection with recompute budget B (the encoding window and the
key scale cost nothing per request). Writes ``<out>.json`` (the points, with the product's default
under ``"default"`` and the prompt-injection method it is held against under ``"baseline"``),
``<out>.md`` and ``<out>.png`` (F1 overall and multi-hop against requests/s).

    python benchmarks/tradeoff.py --accuracy benchmarks/results/locomo_qwen15_h200.json \\
        --load benchmarks/results/vllm_serve_load_budgets_h200.json --users 100 --k 50 \\
        --default 'kv[neighbours=20,closing=answer]' --baseline 'prompt[closing=answer]' \\
        --out benchmarks/results/tradeoff_qwen15_h200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: the categories a point reports (LoCoMo's numbering) besides "all"
CATEGORIES = {"1": "multi-hop", "2": "temporal"}


def system_of(method: dict) -> str:
    """The load run's system that costs what ``method`` costs per request."""
    if method["mode"] == "prompt":
        return "prompt"
    return f"kv@{method['recompute_tokens']}"


def throughput(load: dict, users: int) -> dict[str, float]:
    """requests/s per system at ``users`` concurrent users."""
    rows = {r["system"]: r["requests_per_s"] for r in load["rows"] if r["users"] == users}
    if not rows:
        raise SystemExit(f"the load run has no rows at {users} users (it has {sorted({r['users'] for r in load['rows']})})")
    return rows


def points(accuracy: dict, load: dict, users: int, k: int) -> list[dict]:
    """One point per method of the accuracy run whose system the load run measured."""
    rates = throughput(load, users)
    out = []
    for method in accuracy["methods"]:
        summary = accuracy["summary"].get(method["name"], {})
        system = system_of(method)
        if str(k) not in summary or system not in rates:
            continue
        f1 = {kk: {c: s[f"f1.{c}"] for c in ("all", *CATEGORIES)} for kk, s in summary.items()}
        out.append({"method": method["name"], "system": system, "requests_per_s": rates[system],
                    "x_prompt": rates[system] / rates["prompt"], "f1": f1,
                    "recomputed_tokens": summary[str(k)]["recomputed"]})
    return out


def table(result: dict) -> str:
    k, ks = result["k"], result["ks"]
    base = next((p for p in result["points"] if p["method"] == result["baseline"]), None)
    lines = [f"# Accuracy against throughput: {result['model']}", "",
             f"F1 on {result['questions']} LoCoMo questions (token F1; all / multi-hop / temporal) and requests/s "
             f"at {result['users']} users (`vllm_serve_load.py`, {result['load_model']}, k = {result['load_k']}).",
             f"Default: `{result['default']}`; baseline: `{result['baseline']}`.", "",
             "| method | load system | req/s | × prompt | recomputed tok (k = %d) | " % k
             + " | ".join(f"k = {kk}" for kk in ks) + " |",
             "|---|---|---|---|---|" + "---|" * len(ks)]
    for p in result["points"]:
        cells = []
        for kk in ks:
            f = p["f1"].get(str(kk))
            if not f:
                cells.append("—")
                continue
            cell = " / ".join(f"{f[c]:.3f}" for c in ("all", *CATEGORIES))
            if base and p is not base and str(kk) in base["f1"]:
                cell += " (" + " / ".join(f"{f[c] - base['f1'][str(kk)][c]:+.3f}" for c in ("all", *CATEGORIES)) + ")"
            cells.append(cell)
        mark = " **(default)**" if p["method"] == result["default"] else ""
        lines.append(f"| {p['method']}{mark} | {p['system']} | {p['requests_per_s']:.1f} | {p['x_prompt']:.2f} | "
                     f"{p['recomputed_tokens']:.0f} | " + " | ".join(cells) + " |")
    lines += ["", "In brackets: the difference from the baseline at the same k."]
    return "\n".join(lines) + "\n"


def short_name(method: str) -> str:
    """A method's name without the closing line every method has."""
    name = method.replace("closing=answer", "").replace(",,", ",").replace("[,", "[").replace(",]", "]")
    return name.replace("[]", "")


def plot(result: dict, path: Path) -> None:
    """F1 (all, multi-hop) at ``result["k"]`` against requests/s. The goal region (at least 5x
    prompt injection, F1 within the allowed gap of it) is shaded; a point far below the rest
    (a collapsed method) is drawn on the bottom edge with a downward marker and its F1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = str(result["k"])
    shown = [p for p in result["points"] if k in p["f1"]]
    base = next((p for p in shown if p["method"] == result["baseline"]), None)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, (cat, label, gap) in zip(axes, (("all", "all questions", 0.01), ("1", "multi-hop", 0.02))):
        values = sorted(p["f1"][k][cat] for p in shown)
        floor = values[len(values) // 2] - 0.06  # the median point sets the scale
        below = 0
        for p in shown:
            y = p["f1"][k][cat]
            style = "*" if p["method"] == result["default"] else "s" if p["system"] == "prompt" else "o"
            text = short_name(p["method"])
            lift = 3
            if y < floor:
                style, text, y, lift, below = "v", f"{text}: {y:.3f}", floor, 3 + 9 * below, below + 1
            ax.plot(p["requests_per_s"], y, style, markersize=12 if style == "*" else 6)
            ax.annotate(text, (p["requests_per_s"], y), fontsize=6, xytext=(3, lift), textcoords="offset points")
        if base:
            goal_x, goal_y = 5 * base["requests_per_s"], base["f1"][k][cat] - gap
            ax.axvline(goal_x, color="grey", lw=0.8, ls="--")
            ax.axhline(goal_y, color="grey", lw=0.8, ls="--")
            ax.fill_between([goal_x, max(goal_x, ax.get_xlim()[1]) * 1.05], goal_y, ax.get_ylim()[1] + 0.01,
                            color="tab:green", alpha=0.08, label=f"goal: ≥ 5× prompt, F1 ≥ prompt − {gap}")
            ax.legend(fontsize=7, loc="lower left")
        ax.set_ylim(bottom=floor - 0.005)
        ax.set_xlabel(f"requests/s at {result['users']} users")
        ax.set_ylabel(f"token F1 at k = {k}, {label}")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result['model']}: accuracy against throughput "
                 "(★ the default, ■ prompt injection, ▼ off the scale)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accuracy", required=True, help="a locomo_accuracy.py result (JSON)")
    parser.add_argument("--load", required=True, help="a vllm_serve_load.py result (JSON)")
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--k", type=int, default=50, help="the k the plot and the recomputed tokens are read at")
    parser.add_argument("--default", required=True, help="the product's default method (a name in --accuracy)")
    parser.add_argument("--baseline", required=True, help="the prompt-injection method it is held against")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    accuracy, load = (json.loads(Path(p).read_text()) for p in (args.accuracy, args.load))
    found = points(accuracy, load, args.users, args.k)
    names = {p["method"] for p in found}
    missing = [n for n in (args.default, args.baseline) if n not in names]
    if missing:
        raise SystemExit(f"{missing} not among the methods with a throughput: {sorted(names)}")
    result = {"model": accuracy["model"], "questions": accuracy["questions"], "ks": accuracy["ks"], "k": args.k,
              "users": args.users, "load_model": load["model"], "load_k": load["k"],
              "default": args.default, "baseline": args.baseline,
              "systems": sorted({p["system"] for p in found}), "points": found,
              "sources": {"accuracy": args.accuracy, "load": args.load}, "command": " ".join(["python", *sys.argv])}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(table(result))
    print(table(result))
    try:
        plot(result, out.with_suffix(".png"))
    except ImportError as exc:
        print(f"no plot ({exc})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
