"""The questions asked and the facts retrieved for them: LoCoMo's conversations (all, or a stratified
sample), each question's top facts under the retrieval embedder (cached), the recall of its evidence,
and each fact's nearest facts (for the nearest-facts windows)."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from inferscale.datasets.locomo import Conversation, load_all, stratified_sample

from .scoring import recall


@dataclass
class Item:
    """One question of one conversation, with the facts retrieved for it."""

    conv: str
    index: int
    question: str
    answer: str
    category: int
    evidence: tuple[str, ...]
    retrieved: list[int]  # indices into the conversation's facts, best first


def load_items(args) -> tuple[dict[str, Conversation], list[tuple[str, int]]]:
    convs = {c.sample_id: c for c in load_all(args.data)}
    keys = [(cid, i) for cid, c in convs.items() for i in range(len(c.questions))]
    if args.sample:
        keys = stratified_sample(keys, args.sample, key=lambda k: convs[k[0]].questions[k[1]].category, seed=args.seed)
    return convs, keys


def retrieve(convs: dict[str, Conversation], keys, top: int, cache: Path | None, embedder_name: str) -> dict:
    """(conv, question index) → retrieved fact indices; read from / written to ``cache``."""
    if cache and cache.exists():
        saved = json.loads(cache.read_text())
        if saved["top"] >= top:
            return {(c, int(i)): v[:top] for c, rows in saved["retrieved"].items() for i, v in rows.items()}
    from inferscale.config import BackendSpec, build

    embedder = build("embedder", BackendSpec(embedder_name))
    out: dict = {}
    for cid, conv in convs.items():
        facts = [text for text, _ in conv.all_facts()]
        fact_vecs = embedder.embed(facts)
        questions = [q.question for q in conv.questions]
        scores = embedder.embed(questions) @ fact_vecs.T
        best = scores.topk(min(top, len(facts)), dim=1).indices.tolist()
        for i in range(len(questions)):
            out[(cid, i)] = best[i]
    if cache:
        rows: dict = defaultdict(dict)
        for (c, i), v in out.items():
            rows[c][str(i)] = v
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"top": top, "embedder": embedder_name, "retrieved": rows}))
    return out


def make_items(convs, keys, retrieved, top: int) -> list[Item]:
    return [Item(cid, i, q.question, q.answer, q.category, q.evidence, retrieved[(cid, i)][:top])
            for cid, i in keys for q in [convs[cid].questions[i]]]


def recall_at(items: list[Item], convs, ks) -> dict:
    """Mean recall@k of the evidence turns, overall and per category, and the ceiling (all facts)."""
    out: dict = {}
    for k in [*ks, "all"]:
        per: dict = defaultdict(list)
        for it in items:
            facts = convs[it.conv].all_facts()
            chosen = range(len(facts)) if k == "all" else it.retrieved[:k]
            covered = {t for j in chosen for t in convs[it.conv].cited[facts[j][0]]}
            r = recall(it.evidence, covered)
            if r is not None:
                per[str(it.category)].append(r)
                per["all"].append(r)
        out[str(k)] = {c: sum(v) / len(v) for c, v in per.items()}
    return out


#: the most neighbours any method reads (the related cache keeps this many per fact)
MAX_NEIGHBOURS = 20


def related_ranks(convs, cache: Path | None, embedder_name: str) -> dict[str, list[list[int]]]:
    """Per conversation, each fact's nearest facts (indices, the nearest first) under the retrieval
    embedder, as :func:`inferscale.encode.related.nearest` ranks them; read from / written to ``cache``."""
    if cache and cache.exists():
        saved = json.loads(cache.read_text())
        if saved["top"] >= MAX_NEIGHBOURS and set(convs) <= set(saved["related"]):
            return saved["related"]
    from inferscale.config import BackendSpec, build
    from inferscale.encode.related import nearest

    embedder = build("embedder", BackendSpec(embedder_name))
    out = {}
    for cid, conv in convs.items():
        names = [str(j) for j in range(len(conv.all_facts()))]
        vectors = embedder.embed([text for text, _ in conv.all_facts()])
        ranked = nearest(names, vectors, set(names), MAX_NEIGHBOURS)
        out[cid] = [[int(j) for j in reversed(ranked[n])] for n in names]
    if cache:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"top": MAX_NEIGHBOURS, "embedder": embedder_name, "related": out}))
    return out


def needed_facts(items: list[Item], k: int) -> dict[str, list[int]]:
    """The facts any question retrieves in its top k, per conversation."""
    out: dict = defaultdict(set)
    for it in items:
        out[it.conv].update(it.retrieved[:k])
    return {c: sorted(v) for c, v in out.items()}
