"""Rows of a load run that decides: each system's repeats, interleaved, summed up as a median with its
spread, as ratios to prompt injection and to the question alone taken within each round, and the
recompute budget the connector chose for each request (from its per-request report).

Used by ``vllm_serve_load.py``; pure functions of its per-run rows, so they are tested without a server.
"""

from __future__ import annotations

import statistics
from collections import Counter

#: the systems every ratio is taken against
PROMPT, NONE = "prompt", "none"
#: what joins a KV system to the store (server) serving it, where several run side by side: ``kv@0 on pinned:auto``
ON = " on "
#: per-run numbers that are summed over the repeats rather than taken at their median
SUMMED = ("requests", "failed", "reported")


def round_order(systems: list[str]) -> list[str]:
    """One round's order: prompt injection, the KV systems, the question alone (so every KV row sits
    between the two it is compared with)."""
    kv = [s for s in systems if s not in (PROMPT, NONE)]
    return [*([PROMPT] if PROMPT in systems else []), *kv, *([NONE] if NONE in systems else [])]


def budget_summary(reports: list[dict | None]) -> dict:
    """The recompute budgets the connector reported for a run's requests: their mean, their
    histogram, the memory tokens recomputed on average and the share of requests whose adaptive
    budget met a busy engine (requests that fell back or carried no report are left out)."""
    told = [r for r in reports if r and r.get("fallback") is None and "recompute_budget" in r]
    if not told:
        return {}
    budgets = [r["recompute_budget"] for r in told]
    adaptive = [r["engine_busy"] for r in told if r.get("engine_busy") is not None]
    return {"budget_mean": statistics.fmean(budgets),
            "budget_histogram": {str(b): n for b, n in sorted(Counter(budgets).items())},
            "recomputed_mean": statistics.fmean(r["recomputed_tokens"] for r in told),
            "busy_share": statistics.fmean(adaptive) if adaptive else None, "reported": len(told)}


def ratios(runs: list[dict], system: str, users: int, base: str) -> list[float]:
    """``system``'s requests/s over ``base``'s in each round both ran at ``users`` users."""
    rate = {(r["system"], r["repeat"]): r["requests_per_s"] for r in runs if r["users"] == users}
    return [rate[system, i] / rate[base, i] for s, i in rate if s == system and rate.get((base, i))]


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def aggregate(runs: list[dict], first_store: str | None = None) -> list[dict]:
    """One row per (users, system): the median of every per-run number with the spread of
    requests/s, the within-round ratios to prompt injection (``x_prompt``) and to the question alone
    (``x_none``), and the budgets pooled over every repeat. With stores side by side (systems named
    ``kv@B on STORE``), a KV system also gets its within-round ratio to ``kv@B on first_store``
    (``x_first_store``); a run of one store has no such systems."""
    keys = list(dict.fromkeys((r["users"], r["system"]) for r in runs))
    return [_row(runs, users, system, first_store) for users, system in keys]


def _row(runs: list[dict], users: int, system: str, first_store: str | None = None) -> dict:
    mine = [r for r in runs if (r["users"], r["system"]) == (users, system)]
    row = {"users": users, "system": system, "repeats": len(mine)}
    for key in mine[0]:
        values = [r.get(key) for r in mine]
        if key in SUMMED:
            row[key] = sum(values)
        elif key not in row and key != "repeat" and all(_number(v) for v in values):
            row[key] = statistics.median(values)
    row["requests_per_s_spread"] = spread([r["requests_per_s"] for r in mine])
    row["errors"] = sorted({e for r in mine for e in r.get("errors", [])})[:5]
    for name, base in (("x_prompt", PROMPT), ("x_none", NONE)):
        row[name] = spread(ratios(runs, system, users, base))
    kv, on, _ = system.partition(ON)
    if first_store and on:
        row["x_first_store"] = spread(ratios(runs, system, users, f"{kv}{ON}{first_store}"))
    row.update(_pooled_budgets(mine))
    return row


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _pooled_budgets(mine: list[dict]) -> dict:
    histogram: Counter[str] = Counter()
    for r in mine:
        histogram.update(r.get("budget_histogram", {}))
    if not histogram:
        return {}
    told = sum(histogram.values())
    busy = [(r["busy_share"], r["reported"]) for r in mine if r.get("busy_share") is not None]
    return {"budget_histogram": dict(sorted(histogram.items(), key=lambda kv: int(kv[0]))),
            "budget_mean": sum(int(b) * n for b, n in histogram.items()) / told,
            "recomputed_mean": sum(r["recomputed_mean"] * r["reported"] for r in mine if "reported" in r) / told,
            "busy_share": sum(s * n for s, n in busy) / sum(n for _, n in busy) if busy else None}


def cell(s: dict, digits: int = 2) -> str:
    """``median (min-max)``, or the median alone for one repeat."""
    if not s:
        return "—"
    if s["min"] == s["max"]:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def budget_cell(row: dict) -> str:
    """The mean budget chosen and its histogram (``B: requests``)."""
    if "budget_histogram" not in row:
        return "—"
    return f"{row['budget_mean']:.0f} ({', '.join(f'{b}: {n}' for b, n in row['budget_histogram'].items())})"
