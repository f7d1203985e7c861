"""The facts an encode call is given, as the encoder reads them: duplicates dropped, each
fact's source turn and related facts looked up."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from inferscale.encode.window import Turn
from inferscale.facts import Fact


def unique_facts(facts: Sequence[Fact]) -> list[Fact]:
    """Facts with duplicate fact_ids dropped (the same id must mean the same text)."""
    seen: dict[str, Fact] = {}
    for fact in facts:
        other = seen.setdefault(fact.fact_id, fact)
        if other.text != fact.text:
            raise ValueError(f"fact_id {fact.fact_id!r} is given twice with different texts")
    return list(seen.values())


def related_ids(facts: Sequence[Fact], rendered: Sequence[Sequence[int]], chosen: Sequence[int],
                 related: Mapping[str, Sequence[str]] | None, wanted: int) -> dict[int, list[Sequence[int]]]:
    """Per chosen fact (by index), the token ids of its related facts, the most related last;
    empty lists when the policy reads none."""
    if not wanted:
        return {i: [] for i in chosen}
    if related is None:
        raise ValueError("this window policy encodes facts behind their related facts: pass related=")
    position = {fact.fact_id: i for i, fact in enumerate(facts)}
    out: dict[int, list[Sequence[int]]] = {}
    for i in chosen:
        ids = related.get(facts[i].fact_id, ())
        unknown = [fid for fid in ids if fid not in position]
        if unknown:
            raise ValueError(f"fact {facts[i].fact_id!r}: related facts {unknown[:3]} are not among the facts given")
        out[i] = [rendered[position[fid]] for fid in ids if fid != facts[i].fact_id]
    return out


def source_index(turns: Sequence[Turn]) -> dict[str, int]:
    """turn_id → index of its first occurrence."""
    index: dict[str, int] = {}
    for i, turn in enumerate(turns):
        index.setdefault(turn.turn_id, i)
    return index
