"""The pure parts of ``tier_users.py``: memory-tier budgets, Zipf popularity, the connector's
counters per tier, and the report. Functions of numbers and rows, tested without a server.
"""

from __future__ import annotations

import bisect
import itertools
import json
import random
import re
import statistics

import load_rows

#: the store of every user in HBM, which the other stores' rows are set beside
ALL_IN_HBM = "hbm:all"
#: how the report names ``Config.kv_dtype_at_rest``
AT_REST = {"model": "the model's dtype", "fp8_e4m3": "fp8 (e4m3)"}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)?")
_UNITS = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


# ---------------------------------------------------------------- the memory tiers run

def parse_stores(spec: str) -> list[tuple[str, str]]:
    """``"pinned:30%,hbm:all"`` → ``[("pinned", "30%"), ("hbm", "all")]``; a ValueError names a bad entry."""
    stores = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        tier, _, budget = entry.partition(":")
        if tier not in ("pinned", "hbm") or not budget:
            raise ValueError(f"a store is pinned:BUDGET or hbm:BUDGET, got {entry!r}")
        budget_bytes(budget, 1, 1, tier=tier)  # checked before any engine starts
        stores.append((tier, budget))
    if not stores:
        raise ValueError("no store given")
    return stores


def budget_bytes(budget: str, user_bytes: int, users: int, internal_bytes: int = 0, *, tier: str = "pinned") -> int:
    """The memory tier's ``max_bytes`` for ``budget``: ``N%`` of the ``users`` users' K/V,
    ``all`` (every user, and a quarter more for the facts written while the run goes on),
    ``default`` (the budget the product gives ``tier`` on this machine: a quarter of its memory
    per GPU for ``pinned``, 4 GiB for ``hbm``) or a size (``4GiB``, ``512MiB``, bytes); the
    instruction prefix's ``internal_bytes`` (never evicted) come on top of a share."""
    if budget == "default":
        return default_budget(tier)
    if budget == "all":
        return int(users * user_bytes * 1.25) + internal_bytes + (64 << 20)
    if budget.endswith("%"):
        share = float(budget[:-1])
        if not 0 < share <= 100:
            raise ValueError(f"a budget share lies in (0, 100] %, got {budget!r}")
        return int(users * user_bytes * share / 100) + internal_bytes
    match = _SIZE.fullmatch(budget)
    if not match:
        raise ValueError(f"a budget is N%, all, default or a size such as 4GiB, got {budget!r}")
    return int(float(match[1]) * _UNITS[match[2]])


def memory_tier(tier: str):
    """A store of memory tier ``tier`` (``pinned`` or ``hbm``) as this machine would build it by
    default, holding nothing: what its budget and a user's footprint in it are here."""
    from inferscale.storage.hbm import HBMStore
    from inferscale.storage.pinned import PinnedHostStore

    stores = {"pinned": PinnedHostStore, "hbm": HBMStore}
    if tier not in stores:
        raise ValueError(f"a memory tier is pinned or hbm, got {tier!r}")
    return stores[tier](stores[tier].Options(device="cpu"))


def default_budget(tier: str) -> int:
    """The ``max_bytes`` the product resolves ``"auto"`` to for memory tier ``tier`` on this machine."""
    return memory_tier(tier).max_bytes


def user_footprint(tier: str, user_bytes: int) -> int:
    """What one user of ``user_bytes`` of K/V takes of memory tier ``tier``'s budget here
    (:meth:`~inferscale.storage.resident.store.ResidentStore.footprint`)."""
    return memory_tier(tier).footprint(user_bytes)


class Popularity:
    """Zipf(``s``) popularity over users in rank order: the i-th is asked for with weight ``(i + 1)^-s``."""

    def __init__(self, users: list[str], s: float):
        if not users or s < 0:
            raise ValueError("popularity needs users and an exponent >= 0")
        self.users, self.s = list(users), s
        self.cumulative = list(itertools.accumulate((i + 1) ** -s for i in range(len(users))))

    def draw(self, rng: random.Random) -> str:
        return self.users[bisect.bisect_right(self.cumulative, rng.random() * self.cumulative[-1])]

    def share(self, top: int) -> float:
        """The share of requests for the ``top`` most popular users: the hit rate of a cache that
        always held them (the best any cache of that many users does on independent draws)."""
        top = max(0, min(top, len(self.users)))
        return self.cumulative[top - 1] / self.cumulative[-1] if top else 0.0


# ---------------------------------------------------------------- the connector's counters

def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The counters that moved between two ``connector_counters`` snapshots."""
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    return {key: value for key, value in delta.items() if value}


def by_label(counts: dict[str, float], name: str) -> dict[str, float]:
    """``{label value: count}`` of one labelled counter (``store_hits_total``, ``store_bytes_total``,
    ``fallbacks_total``) among ``counts``."""
    head = f"{name}{{"
    return {key[len(head):-1].partition("=")[2]: value for key, value in counts.items() if key.startswith(head)}


def tier_totals(runs: list[dict]) -> dict:
    """The loads of ``runs`` (their ``connector`` deltas) summed: hits and bytes per tier, each
    tier's share of the hits, its bytes per second of the runs, requests injected and fallen back."""
    hits: dict[str, float] = {}
    nbytes: dict[str, float] = {}
    fallbacks: dict[str, float] = {}
    for run in runs:
        for into, name in ((hits, "store_hits_total"), (nbytes, "store_bytes_total"), (fallbacks, "fallbacks_total")):
            for label, value in by_label(run.get("connector", {}), name).items():
                into[label] = into.get(label, 0.0) + value
    seconds = sum(run["seconds"] for run in runs) or 1e-9
    loads = sum(hits.values())
    return {"hits": hits, "hit_rate": {tier: n / loads for tier, n in hits.items()} if loads else {},
            "bytes": nbytes, "bytes_per_s": {tier: n / seconds for tier, n in nbytes.items()},
            "loads": loads, "injected": sum(run.get("connector", {}).get("injected_requests_total", 0.0)
                                            for run in runs),
            "fallbacks": fallbacks}


# ---------------------------------------------------------------- rows and the report

def store_rows(store: str, runs: list[dict]) -> list[dict]:
    """One store's rows: ``load_rows.aggregate``'s (medians, within-round ratios to prompt
    injection) with the tier totals of each system's runs and the users they asked for."""
    rows = []
    for row in load_rows.aggregate(runs):
        mine = [r for r in runs if r["system"] == row["system"]]
        row.update(store=store, tiers=tier_totals(mine), writes=sum(r.get("writes", 0) for r in mine),
                   distinct_users=len(set().union(*(r.get("asked", []) for r in mine))))
        rows.append(row)
    return rows


def x_all_in_hbm(rows: list[dict], reference: list[dict]) -> None:
    """Each KV row's requests/s over the same system's with every user in HBM (the ``reference``
    rows, of store ``hbm:all``): medians of runs on two engines, one after the other (``x_hbm``)."""
    base = {r["system"]: r["requests_per_s"] for r in reference if r["store"] == ALL_IN_HBM}
    for row in rows:
        if row["system"] in base and row["system"] != load_rows.PROMPT and base[row["system"]]:
            row["x_hbm"] = row["requests_per_s"] / base[row["system"]]


def cold_summary(probes: list[dict]) -> dict:
    """Per kind of probe (``disk``, ``page_cache``, ``memory``, ``prompt``): the median client TTFT
    (ms), how many, and the tiers the connector counted for them."""
    out = {}
    for kind in dict.fromkeys(p["kind"] for p in probes):
        mine = [p for p in probes if p["kind"] == kind]
        ttfts = [p["ttft_ms"] for p in mine if p.get("ttft_ms") is not None]
        tiers: dict[str, float] = {}
        for p in mine:
            for tier, n in p.get("hits", {}).items():
                tiers[tier] = tiers.get(tier, 0.0) + n
        out[kind] = {"ttft_ms": statistics.median(ttfts) if ttfts else None, "n": len(ttfts),
                     "failed": sum(not p["ok"] for p in mine), "tiers": tiers}
    return out


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _percent(value: float) -> str:
    return f"{value:.0%}"


def _shares(tiers: dict, key: str, scale: float = 1.0, fmt: str = "{:.0%}") -> str:
    values = tiers.get(key, {})
    return " / ".join(f"{tier} {fmt.format(v * scale)}" for tier, v in sorted(values.items())) or "—"


def markdown(result: dict) -> str:
    """The report: throughput per memory tier, a cold user's cost, the writes."""
    size = result["sizes"]
    lines = [f"# {result['users']:,} users per GPU: {result['model']}", "", f"`{result['command']}`", "",
             f"{result['users']:,} users ({result['probe_users']} more for the cold-user probes), "
             f"{result['facts_per_user']} facts a user of {result['fact_tokens']} tokens, K/V at rest in "
             f"{AT_REST.get(result['kv_dtype_at_rest'], result['kv_dtype_at_rest'])}: {size['user_mib']:.2f} MiB a "
             f"user, {size['all_gib']:.2f} GiB in all. "
             f"Popularity Zipf({result['zipf']}); {result['concurrency']} clients in a closed loop, each request "
             f"for a user drawn by popularity, k = {result['k']} of their facts ({result['memory_tokens']} memory "
             f"tokens), {result['max_tokens']} output tokens. A writer adds {result['write_facts']} fact(s) to a user "
             f"drawn by popularity {result['writes_per_s']} times a second during every row, through the store of "
             f"record. Each row: {result['seconds']:.0f} s, the median of {result['repeats']} interleaved rounds "
             f"(min-max); the page cache of the store of record dropped before each. Async loads: "
             f"{result['async_loads']}.", "",
             "| memory tier (budget) | holds | system | requests/s | × prompt injection | × every user in HBM | "
             "engine TTFT mean ms | engine TTFT p50 / p99 ≤ ms | hits per tier | ideal hit rate | "
             "bytes read per tier, GB/s | fallbacks | users asked | writes | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for store in result["stores"]:
        for row in (r for r in result["rows"] if r["store"] == store["store"]):
            kv = row["system"] != load_rows.PROMPT
            tiers = row["tiers"]
            lines.append(
                f"| {store['store']} ({store['max_bytes'] / 2**30:.1f} GiB) | {store['holds_users']:.0f} users | "
                f"{row['system']} | {load_rows.cell(row['requests_per_s_spread'])} | "
                f"{load_rows.cell(row.get('x_prompt'))} | {_ratio(row.get('x_hbm'))} | "
                f"{row.get('ttft_mean_ms', 0):.1f} | {_ms(row.get('ttft_p50_le_ms'))} / "
                f"{_ms(row.get('ttft_p99_le_ms'))} | {_shares(tiers, 'hit_rate') if kv else '—'} | "
                f"{_percent(store['ideal_hit_rate']) if kv else '—'} | "
                f"{_shares(tiers, 'bytes_per_s', 1e-9, '{:.3g}') if kv else '—'} | "
                f"{int(sum(tiers['fallbacks'].values())) if kv else '—'} | {row['distinct_users']} | "
                f"{row['writes']} | {row['failed']} |")
    lines += ["", "A cold user's cost: lone requests on an idle engine, client time to the first token (streamed), "
              "median ms of the probes (the tier the connector counted for them in brackets).", "",
              "| memory tier (budget) | prompt injection | user in the memory tier | user on disk, in the page cache | "
              "user on disk only |", "|---|---|---|---|---|"]
    for store in result["stores"]:
        cold = store["cold_user"]

        def cell(kind: str) -> str:
            got = cold.get(kind)
            if not got:
                return "—"
            tiers = ", ".join(f"{t} {n:.0f}" for t, n in sorted(got["tiers"].items()))
            return f"{_ms(got['ttft_ms'])}" + (f" ({tiers})" if tiers else "")

        lines.append(f"| {store['store']} | {cell('prompt')} | {cell('memory')} | {cell('page_cache')} | "
                     f"{cell('disk')} |")
    writes = result["writes"]
    lines += ["", f"Writes: {writes['writes']} committed ({writes['facts']} facts) beside the load, write time p50 "
              f"{_ms(writes.get('p50_ms'))} ms / p99 {_ms(writes.get('p99_ms'))} ms, {writes['errors']} failed; "
              f"listed after the run: {writes['facts'] - writes['lost']} of {writes['facts']} "
              f"(lost: {writes['lost']}).", "",
              f"Checks: {json.dumps(result['checks'])}"]
    return "\n".join(lines) + "\n"
