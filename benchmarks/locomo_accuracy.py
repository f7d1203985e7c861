"""LoCoMo answer accuracy: KV injection (several ways) vs prompt injection, on the same retrieved facts.

Every conversation in ``--data`` loads (all sessions; facts are LoCoMo's observations, dated by
session, encoded behind their source turn) and every category-1–4 question is asked, or a
stratified, seeded subsample with ``--sample N`` (for CPU smoke runs only). For each question the
top-k facts are retrieved once (the configured embedder and the exact retriever); every method
answers from exactly those facts, so methods differ only in how the facts reach the KV cache:

* ``prompt*`` — the facts prefilled as text (prompt injection, the Mem0-style baseline);
* ``kv*``     — the facts' stored K/V injected by the connector, with a recompute budget
  (the tail facts that fit are prefilled), a key scale, a fact style (bullet / line), a
  closing line after the facts (prefilled) and an encoding window (turns before each fact).

All prompts of one (method, k) go to vLLM in one ``generate`` call. Scores: LoCoMo's token F1
and containment (the normalised gold answer appears in the answer), per category and overall;
retrieval recall@k of the questions' evidence turns (a fact covers the turns it cites).

    python benchmarks/locomo_accuracy.py --data ../shared/data/locomo --methods grid \\
        --ks 5,10,20,50 --out benchmarks/results/locomo_qwen05_h200.json
    python benchmarks/locomo_accuracy.py --sample 60 --ks 5,10 --methods smoke   # CPU smoke run

Writes ``--out`` (config, summary, recall) with the per-question answers beside it
(``*_answers.json.gz``) and a markdown table (``*.md``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import string
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import locomo_gaps  # noqa: E402

from inferscale.config import DEFAULT_CLOSING  # noqa: E402
from inferscale.datasets.locomo import CATEGORIES, Conversation, load_all, stratified_sample  # noqa: E402

INSTRUCTION = (
    "You answer questions about a conversation between two people, using the facts below that were "
    "remembered from it. Answer in a few words, with a date when asked when.\nFacts:\n"
)
#: text after the facts, before the question (always prefilled)
CLOSINGS = {"none": "", "answer": DEFAULT_CLOSING}


# ---------------------------------------------------------------- scoring


def normalize(text: str) -> list[str]:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the|and)\b", " ", text)
    return text.split()


def f1(prediction: str, gold: str) -> float:
    """LoCoMo's token F1 (normalised as in the LoCoMo and Mem0 evaluations)."""
    pred, ref = normalize(prediction), normalize(gold)
    common = sum((Counter(pred) & Counter(ref)).values())
    if not pred or not ref or common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def contains(prediction: str, gold: str) -> float:
    """1.0 when the normalised gold answer appears, as a phrase, in the normalised prediction."""
    ref = " ".join(normalize(gold))
    return float(bool(ref) and f" {ref} " in f" {' '.join(normalize(prediction))} ")


def recall(evidence: tuple[str, ...], covered: set[str]) -> float | None:
    """Share of a question's evidence turns cited by the retrieved facts (None: no evidence)."""
    return sum(e in covered for e in evidence) / len(evidence) if evidence else None


# ---------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    name: str
    mode: str = "kv"  # kv | prompt
    window: int = 2  # turns before each fact ("turns" policy); negative: the -window facts before it ("facts")
    style: str = "bullet"
    closing: str = "none"
    recompute_tokens: int = 0
    key_scale: float = 1.0
    neighbours: int = 0  # > 0: the "neighbours" policy, each fact behind its nearest facts (window unused)
    order: str = "relevance"  # the composer: "relevance" (most relevant last) or "stored" (as stored)
    # "0/5/20": every fact encoded behind 0, 5 and 20 facts; each slot of a segment reads the encoding
    # whose window is nearest to the number of facts before that slot (the window unused)
    slots: str = ""
    # the content part of the facts' stored keys scaled at encoding, around the key bias:
    # k = b + c (k - b), a softmax temperature 1/c on what the keys say (see content_scaled)
    content_scale: float = 1.0
    # "f10/n10": every fact encoded behind the 10 facts stored before it and behind its 10 nearest;
    # a request reads, for each fact, the encoding whose context holds more of the facts retrieved
    # with it (the first listed on a tie; see Contexts.choose; the window unused)
    contexts: str = ""
    # a benchmarks/kv_calibration.py JSON (inferscale.encode.calibration): scales (and shifts) on
    # the stored keys' content and values, fitted offline against prompt injection (replaces content_scale)
    calibration: str = ""
    # a fact wrappers file (inferscale.encode.wrappers): learned embeddings around every fact at encoding
    wrappers: str = ""

    @property
    def encoding(self) -> tuple[int, str, int, float]:
        return (0 if self.neighbours else self.window), self.style, self.neighbours, self.transform

    @property
    def encodings(self) -> list[tuple[int, str, int]]:
        """Every encoding a request of this method may read."""
        if self.contexts:
            return [context_encoding(c, self.style, self.transform) for c in self.contexts.split("/")]
        return [(-w, self.style, 0, self.transform) for w in self.windows] if self.slots else [self.encoding]

    @property
    def transform(self) -> float | str:
        """What the stored K/V go through: a key content scale, a calibration file, or (at the model's
        pass) fact wrappers (``"wrappers:<file>"``)."""
        if self.wrappers and (self.calibration or self.content_scale != 1.0):
            raise ValueError(f"{self.name}: wrappers are trained for the plain K/V (no calibration or content scale)")
        return self.calibration or (f"{WRAPPED}{self.wrappers}" if self.wrappers else self.content_scale)

    @property
    def windows(self) -> list[int]:
        return sorted(int(w) for w in self.slots.split("/")) if self.slots else []

    def encoding_at(self, slot: int) -> tuple[int, str, int, float]:
        """The encoding the fact at ``slot`` (that many facts before it) reads."""
        if not self.slots:
            return self.encoding
        best = min(self.windows, key=lambda w: (abs(w - slot), -w))
        return -best, self.style, 0, self.transform


#: the transform of an encoding with fact wrappers: this prefix, then the wrappers file
WRAPPED = "wrappers:"


def wrappers_of(transform: float | str) -> str:
    """The wrappers file of an encoding's transform ("" if none)."""
    return transform[len(WRAPPED):] if isinstance(transform, str) and transform.startswith(WRAPPED) else ""


def context_encoding(spec: str, style: str, scale: float) -> tuple[int, str, int, float]:
    """``"f10"``: behind the 10 facts stored before it; ``"n10"``: behind its 10 nearest facts."""
    kind, count = spec[0], int(spec[1:])
    if kind not in "fn" or count <= 0:
        raise ValueError(f"unknown context {spec!r}: f<count> (facts stored before) or n<count> (nearest)")
    return (-count, style, 0, scale) if kind == "f" else (0, style, count, scale)


class Contexts:
    """What each fact of a conversation was encoded behind, per encoding: the facts stored before it
    (a facts window) or its nearest facts (``ranks``, from :func:`related_ranks`)."""

    def __init__(self, ranks: dict[str, list[list[int]]]):
        self.ranks = ranks

    def context(self, conv: str, j: int, encoding: tuple[int, str, int, float]) -> set[int]:
        window, _, neighbours, _ = encoding
        if neighbours:
            return set(self.ranks[conv][j][:neighbours])
        return set(range(max(0, j + window), j)) if window < 0 else set()

    def choose(self, method: Method, conv: str, j: int, retrieved: set[int]) -> tuple[int, str, int, float]:
        """The encoding of fact ``j`` whose context holds the most of the other ``retrieved`` facts."""
        others = retrieved - {j}
        return max(method.encodings, key=lambda e: len(self.context(conv, j, e) & others))


def _kv(**kw) -> Method:
    parts = [f"{k}={v}" for k, v in kw.items()]
    return Method("kv" + ("[" + ",".join(parts) + "]" if parts else ""), **kw)


def _prompt(**kw) -> Method:
    parts = [f"{k}={v}" for k, v in kw.items()]
    return Method("prompt" + ("[" + ",".join(parts) + "]" if parts else ""), mode="prompt", **kw)


def method_sets() -> dict[str, list[Method]]:
    """Named sets. ``window=-5`` encodes each fact behind the 5 facts before it (as it will be
    read: in a list of facts) instead of behind conversation turns. The grid runs the most
    telling methods first, so a run cut short keeps them."""
    fw = dict(window=-5)
    first = [_prompt(), _kv(**fw), _kv(), _kv(**fw, recompute_tokens=256), _kv(recompute_tokens=256),
             _kv(window=-20), _kv(window=-20, recompute_tokens=256), _prompt(closing="answer"),
             _kv(**fw, closing="answer"), _kv(**fw, closing="answer", recompute_tokens=256)]
    budgets = [_kv(**fw, recompute_tokens=b) for b in (32, 64, 128, 512)]
    scales = [_kv(**fw, key_scale=c) for c in (1.1, 1.25)]
    styles = [_kv(**fw, style="line"), _prompt(style="line")]
    windows = [_kv(window=w) for w in (0, 5, 20)] + [_kv(closing="answer")]
    return {
        "grid": first + budgets + scales + styles + windows,
        "smoke": [_prompt(), _kv(), _kv(**fw), _kv(**fw, recompute_tokens=64), _kv(slots="0/5/20"),
                  _kv(**fw, content_scale=1.1), _kv(contexts="f5/n5")],
        # the product's defaults on a GPU (facts window 5, closing line, B = 256) vs the same prompt
        "default": [_prompt(closing="answer"), _kv(**fw, closing="answer", recompute_tokens=256)],
        # offline context that matches the serving context (nearest facts), small tails, key scales
        "neighbours": neighbour_grid(),
        "neighbours05": neighbour_check(),
        # the stored-order composer against relevance order, with facts windows and small tails
        "order": order_grid(),
        "order05": order_check(),
        # what recovers accuracy at no per-request cost (key scales, slot-matched windows) against small tails
        "tradeoff": tradeoff_grid(),
        "tradeoff05": tradeoff_check(),
        "temperature": temperature_grid(),
        "context": context_grid(),
        "wide": wide_grid(),
        "depth": depth_grid(),
        "calibrated": calibrated_grid(),
        # both zero-cost families not yet measured on the 1.5B, in one run (calibrated's rows first)
        "offline": offline_grid(),
    }


def _anchors(recompute_free: bool = True) -> list[Method]:
    """What every grid is read against: prompt injection (the baseline), the default (facts 5,
    B = 256) and, unless told otherwise, the same facts with nothing recomputed; the closing line."""
    close = dict(closing="answer")
    free = [_kv(window=-5, **close)] if recompute_free else []
    return [_prompt(**close), *free, _kv(window=-5, **close, recompute_tokens=256)]


def context_grid() -> list[Method]:
    """Offline contexts nearer the one a fact is read in, at no per-request cost: each fact behind
    its nearest facts under the retrieval embedder (5, 10, 20: the facts it is most likely
    retrieved with, the most related last, as the relevance composer places them), behind the 10
    facts stored before it, and two windows read by slot (a fact in the first slots behind the 5
    facts before it, a fact deeper in the segment behind 20). Anchors first."""
    close = dict(closing="answer")
    anchors = _anchors()
    nearest = [_kv(neighbours=n, **close) for n in (5, 10, 20)]
    return anchors + nearest + [_kv(slots="5/20", **close), _kv(window=-10, **close)]


def wide_grid() -> list[Method]:
    """The facts window of 10 (the best row of :func:`context_grid` that recomputes nothing) with
    the tails around the 5x line (one fact, B = 32; B = 64) and today's B = 256; anchors first."""
    close = dict(closing="answer")
    anchors = _anchors(recompute_free=False)
    return anchors + [_kv(window=-10, **close, recompute_tokens=b) for b in (32, 64, 256)]


def depth_grid() -> list[Method]:
    """Contexts as deep as the segment a fact is read in, and several contexts per fact, at no
    per-request cost: facts windows of 10 (the best so far) and 40, each slot reading the window
    nearest the facts before it (10 or 40), and each fact reading whichever of its facts-10 and
    nearest-10 (or nearest-20) encodings has more of the facts retrieved with it in its context.
    Anchors first, with the facts window of 10 among them."""
    close = dict(closing="answer")
    anchors = _anchors() + [_kv(window=-10, **close)]
    several = [_kv(contexts="f10/n10", **close), _kv(contexts="f10/n20", **close)]
    return anchors + several + [_kv(slots="10/40", **close), _kv(window=-40, **close)]


#: where the calibrated set reads its corrections (written by benchmarks/kv_calibration.py before the
#: run): per layer and KV head, and per channel with shifts (``--form channel``)
CALIBRATION = "benchmarks/results/kv_calibration_qwen15_h200.json"
CALIBRATION_CHANNEL = "benchmarks/results/kv_calibration_channel_qwen15_h200.json"


def calibrated_grid() -> list[Method]:
    """Stored K/V through corrections fitted offline against prompt injection on facts that are not
    LoCoMo's (:data:`CALIBRATION`, :data:`CALIBRATION_CHANNEL`, fitted for the facts window of 10),
    at B = 0 and with the default tail, against the same windows without them. The facts window of
    10 with and without them comes first, beside prompt injection and the default, so a run cut
    short keeps the comparison."""
    close = dict(closing="answer")
    prompt, free, default = _anchors()
    f10 = dict(window=-10, **close)
    first = [prompt, _kv(**f10), _kv(**f10, calibration=CALIBRATION_CHANNEL), _kv(**f10, calibration=CALIBRATION), default]
    return first + [free, _kv(window=-5, **close, calibration=CALIBRATION_CHANNEL), _kv(window=-5, **close, calibration=CALIBRATION),
                    _kv(**f10, calibration=CALIBRATION, recompute_tokens=256)]


def offline_grid() -> list[Method]:
    """The calibrated set, then the depth set's rows it lacks (one run of both: shared anchors)."""
    rows = calibrated_grid()
    names = {m.name for m in rows}
    return rows + [m for m in depth_grid() if m.name not in names]


def tradeoff_grid() -> list[Method]:
    """Ways to recover cross-fact attention that cost a request nothing — a key scale (a softmax
    temperature over the injected facts), a wider facts window, several windows per fact read by
    slot (a fact behind as many facts as precede it when read) — against tails that fit at 5x or
    near it (B = 32, 64) and larger ones. Anchors first; the closing line everywhere."""
    close = dict(closing="answer")
    anchors = _anchors()
    free = [_kv(window=-5, **close, key_scale=1.05), _kv(slots="0/5/20", **close), _kv(window=-5, **close, key_scale=1.1),
            _kv(window=-20, **close), _kv(window=-5, **close, key_scale=0.95)]
    tails = [_kv(window=-5, **close, recompute_tokens=b) for b in (64, 32, 128)]
    return anchors + free + tails + [_kv(slots="0/5/20", **close, recompute_tokens=64)]


def temperature_grid() -> list[Method]:
    """A temperature on the facts' key content (around the key bias, fixed at encoding) against
    the per-request key scale, which also scales the bias; anchors first."""
    close = dict(closing="answer")
    anchors = _anchors()
    content = [_kv(window=-5, **close, content_scale=c) for c in (1.05, 1.1, 1.2, 0.9)]
    return anchors + content + [_kv(window=-5, **close, content_scale=1.1, recompute_tokens=64),
                                _kv(window=-20, **close, content_scale=1.1)]


def tradeoff_check() -> list[Method]:
    """The smaller model's share of :func:`tradeoff_grid`: the anchors and the free candidates."""
    close = dict(closing="answer")
    return [_prompt(**close), _kv(window=-5, **close, recompute_tokens=256), _kv(window=-5, **close),
            _kv(window=-5, **close, key_scale=1.05), _kv(slots="0/5/20", **close), _kv(window=-5, **close, recompute_tokens=64)]


def order_grid() -> list[Method]:
    """Facts composed in the order they were stored, so a fact encoded behind the facts stored
    before it is read behind the retrieved ones among them, against relevance order: facts
    windows 5/10/20/50, a tail that fits at 5x (B = 16), a key scale, the neighbours window.
    Anchors first; every method with the closing line, as the product serves."""
    close, stored = dict(closing="answer"), dict(closing="answer", order="stored")
    anchors = [_prompt(**close), _prompt(**stored), _kv(window=-5, **close), _kv(window=-5, **stored)]
    windows = [_kv(window=-20, **stored), _kv(window=-10, **stored)]
    tails = [_kv(window=-5, **stored, recompute_tokens=16), _kv(window=-5, **close, recompute_tokens=256)]
    more = [_kv(window=-20, **close), _kv(window=-5, **stored, key_scale=1.05), _kv(window=-50, **stored),
            _kv(neighbours=10, **close)]
    return anchors + windows + tails + more


def order_check() -> list[Method]:
    """The smaller model's share of :func:`order_grid`: today's default and the candidates."""
    close, stored = dict(closing="answer"), dict(closing="answer", order="stored")
    return [_prompt(**close), _prompt(**stored), _kv(window=-5, **close, recompute_tokens=256),
            _kv(window=-5, **stored), _kv(window=-20, **stored), _kv(window=-10, **stored),
            _kv(window=-5, **stored, recompute_tokens=16), _kv(window=-5, **close)]


def neighbour_grid() -> list[Method]:
    """The neighbours policy against the facts window at B = 0, with key scales and small tails;
    every method with the closing line, as the product serves. The anchors come first."""
    close = dict(closing="answer")
    anchors = _anchors()
    windows = [_kv(neighbours=n, **close) for n in (10, 20)] + [_kv(window=-20, **close)]
    scales = [_kv(neighbours=20, **close, key_scale=c) for c in (1.05, 1.1)]
    tails = [_kv(neighbours=20, **close, recompute_tokens=b) for b in (64, 128)]
    return anchors + windows + scales + tails


def neighbour_check() -> list[Method]:
    """The smaller model's share of :func:`neighbour_grid`: today's default and the candidates."""
    close = dict(closing="answer")
    return [_prompt(**close), _kv(window=-5, **close, recompute_tokens=256), _kv(window=-5, **close),
            _kv(neighbours=10, **close), _kv(neighbours=20, **close), _kv(neighbours=20, **close, recompute_tokens=64)]


def select_methods(spec: str) -> list[Method]:
    """A named set, or method names joined by ';' (any ``kv[field=value,...]`` / ``prompt[...]`` parses)."""
    sets = method_sets()
    if spec in sets:
        return sets[spec]
    every = {m.name: m for ms in sets.values() for m in ms}
    return [every[n] if n in every else parse_method(n, sorted(sets)) for n in spec.split(";")]


_NAME = re.compile(r"^(kv|prompt)(?:\[(.*)\])?$")


def parse_method(name: str, sets: list[str] = ()) -> Method:
    """The method a name describes: ``kv[window=-10,recompute_tokens=256]`` (fields of :class:`Method`)."""
    match = _NAME.match(name)
    fields = {f.name: f.type for f in dataclass_fields(Method)}
    if not match:
        raise SystemExit(f"unknown method {name!r}: kv[field=value,...] or prompt[...]; sets: {list(sets)}")
    values = {}
    for part in filter(None, (match.group(2) or "").split(",")):
        key, _, value = part.partition("=")
        if key not in fields or key in ("name", "mode"):
            raise SystemExit(f"method {name!r}: unknown field {key!r}; fields: {sorted(set(fields) - {'name', 'mode'})}")
        values[key] = {"int": int, "float": float}.get(fields[key], str)(value)
    return Method(name, mode=match.group(1), **values)


# ---------------------------------------------------------------- data and retrieval


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


# ---------------------------------------------------------------- encoding


def user_of(conv: str, encoding: tuple[int, str, int, float]) -> str:
    """The user an encoding is stored under. Every facts window, every nearest-facts window and no
    context at all (window 0) share one user, their fact ids tagged by window (:func:`source_tag`),
    so one request can read several encodings."""
    window, style, neighbours, scale = encoding
    kind = "wrap" if wrappers_of(scale) else "cal"
    scaled = f".{kind}-{Path(scale).stem}" if isinstance(scale, str) else f".c{scale:g}" if scale != 1.0 else ""
    return f"{conv}.w{window}.{style}{scaled}" if window > 0 and not neighbours else f"{conv}.facts.{style}{scaled}"


def source_tag(encoding: tuple[int, str, int, float], source: str | None) -> str | None:
    """What a fact id is made from besides user and text: the source turn, and for the facts
    windows (which share a user) the window."""
    window, _, neighbours, _ = encoding
    if neighbours:
        return f"{source}|n{neighbours}"
    return f"{source}|f{-window}" if window <= 0 else source


def window_policy(window: int, neighbours: int = 0):
    """``window`` turns before each fact, (negative) the ``-window`` facts before it, or the
    ``neighbours`` facts nearest to it."""
    from inferscale.config import BackendSpec, build

    if neighbours:
        return build("window", BackendSpec("neighbours", {"window": neighbours}))
    if window >= 0:
        return build("window", BackendSpec("turns", {"window": window}))
    return build("window", BackendSpec("facts", {"window": -window}))


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


def content_scaled(kv, bias, scale: float):
    """``kv`` with its keys' content scaled around the key bias (``bias``: ``[layers, kv_heads,
    head_size]``, :attr:`FactEncoder.key_bias`): ``b + scale (k - b)``.

    A key is ``k = W x + b``; the query's logit on it is ``q . R(k) = q . R(W x) + q . R(b)``. The
    bias term depends only on the two positions (it draws the model's positional patterns, its
    attention sinks among them) and is large on Qwen2 models (|b| up to 354 on the 1.5B's layer 0).
    Scaling the whole key by ``c`` scales that term too, on the injected facts only, and moves their
    attention against the prefix and the question; scaling ``W x`` alone is a temperature on what
    the keys say."""
    from inferscale.encode.calibration import corrected
    from inferscale.kv import FactKV

    keys, _ = corrected(kv.keys.float(), kv.values, bias, scale, 1.0)
    return FactKV(kv.token_ids, keys.to(kv.keys.dtype), kv.values)


def usable(methods: list[Method]) -> list[Method]:
    """``methods`` less those whose calibration file does not load (each is named, with the reason)."""
    from inferscale.encode.calibration import KVCalibration
    from inferscale.errors import ConfigError

    bad = {}
    for path in {m.calibration for m in methods if m.calibration}:
        try:
            KVCalibration.load(path)
        except ConfigError as exc:
            bad[path] = exc
    for m in methods:
        if m.calibration in bad:
            print(f"skipped {m.name}: {bad[m.calibration]}", flush=True)
    return [m for m in methods if m.calibration not in bad]


def kv_encodings(methods: list[Method]) -> list[tuple[int, str, int, float | str]]:
    """Every encoding the K/V methods read, each once, in one order whatever the methods' order (a
    transform is a scale or a calibration file's path, which do not compare: sorted by repr)."""
    return sorted({e for m in methods if m.mode == "kv" for e in m.encodings}, key=repr)


def needed_facts(items: list[Item], k: int) -> dict[str, list[int]]:
    """The facts any question retrieves in its top k, per conversation."""
    out: dict = defaultdict(set)
    for it in items:
        out[it.conv].update(it.retrieved[:k])
    return {c: sorted(v) for c, v in out.items()}


def encode_all(args, convs, needed, encodings, model_dir: str, data_dir: Path, prefix_ids, kv_dtype, ranks) -> dict:
    """Encode the needed facts once per (window, style): (conv, encoding) → {fact index: fact_id};
    ``ranks``: each fact's nearest facts (:func:`related_ranks`), for the nearest-facts windows."""
    import torch

    from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER
    from inferscale.encode.calibration import KVCalibration
    from inferscale.encode.encoder import FactEncoder
    from inferscale.encode.wrappers import FactWrappers
    from inferscale.facts import Fact, make_fact_id
    from inferscale.kv import FactKV
    from inferscale.storage.disk import DiskStore

    disk = DiskStore(DiskStore.Options(root=str(data_dir / "kv")))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids: dict = {}
    with FactEncoder.from_spec(model_dir, dtype="float32", batch_size=args.encode_batch) as encoder:
        encoder.model.to(device)
        calibrations = {path: KVCalibration.load(path) for path in {e[3] for e in encodings if isinstance(e[3], str)
                                                                     and not wrappers_of(e[3])}}

        def cast(kv: FactKV) -> FactKV:
            return FactKV(kv.token_ids, kv.keys.to(kv_dtype), kv.values.to(kv_dtype))

        disk.put(SYSTEM_USER, {PREFIX_FACT: cast(encoder.encode_ids(prefix_ids))})
        # the model runs once per (window, style, neighbours, wrappers); each transform (content
        # scale, calibration) is derived from it
        scales: dict = defaultdict(list)
        for encoding in encodings:
            scales[(*encoding[:3], wrappers_of(encoding[3]))].append(encoding[3])
        for (window, style, neighbours, wrappers), group in scales.items():
            encoder.window = window_policy(window, neighbours)
            encoder.fact_style = style
            encoder.wrappers = FactWrappers.load(wrappers).check(encoder.model) if wrappers else None
            start = time.perf_counter()
            for cid, indices in needed.items():
                conv = convs[cid]
                fact_lists = {}
                for scale in group:
                    encoding = (window, style, neighbours, scale)
                    user = user_of(cid, encoding)
                    fact_lists[scale] = [Fact(make_fact_id(user, text, source_tag(encoding, src)), user, text, src)
                                         for text, src in conv.all_facts()]
                facts = fact_lists[group[0]]
                only = {facts[j].fact_id for j in indices}
                related = {facts[j].fact_id: [facts[r].fact_id for r in reversed(ranks[cid][j][:neighbours])]
                           for j in indices} if neighbours else None
                kvs = encoder.encode(facts, conv.turns, progress=False, prefix_ids=prefix_ids, only=only,
                                     related=related)
                for scale, scaled_facts in fact_lists.items():
                    put = {scaled_facts[j].fact_id: kvs[facts[j].fact_id] for j in indices}
                    if isinstance(scale, str) and not wrappers:
                        put = {fid: calibrations[scale].apply(kv, encoder.key_bias) for fid, kv in put.items()}
                    elif scale != 1.0:
                        put = {fid: content_scaled(kv, encoder.key_bias, scale) for fid, kv in put.items()}
                    disk.put(scaled_facts[0].user_id, {fid: cast(kv) for fid, kv in put.items()})
                    ids[(cid, (window, style, neighbours, scale))] = {j: scaled_facts[j].fact_id for j in indices}
            name = user_of('', (window, style, neighbours, 1.0)).lstrip('.') \
                + (f" n{neighbours}" if neighbours else f" f{-window}" if window <= 0 else "")
            print(f"encoded {name} (transforms {', '.join(c if isinstance(c, str) else f'{c:g}' for c in group)}): "
                  f"{sum(map(len, needed.values()))} facts in {time.perf_counter() - start:.1f} s", flush=True)
    return ids


# ---------------------------------------------------------------- serving


def build_engine(args, model_dir: str, data_dir: Path):
    """The product's engine (``connector.engine.make_llm``): the connector reads ``data_dir``;
    each request sets its own recompute budget and key scale."""
    import torch

    from inferscale.config import Config
    from inferscale.connector.engine import make_llm

    gpu = torch.cuda.is_available()
    config = Config.from_dict({"model": {"path": model_dir, "dtype": args.dtype}, "data_dir": str(data_dir),
                               "instruction": INSTRUCTION, "kv_store": "hbm" if gpu else "pinned",
                               "recompute_tokens": 0})
    # a fixed cache (--kv-cache-gib) skips vLLM's memory profile, which fails when another process on
    # the GPU frees memory while it runs; the utilization is then only the free memory vLLM asks for
    memory = {"gpu_memory_utilization": args.gpu_memory_utilization} if gpu else {"kv_cache_memory_bytes": 2 << 30}
    if gpu and args.kv_cache_gib:
        memory["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    return make_llm(model_dir, config, in_process=True, enforce_eager=not args.cuda_graphs, **memory)


class Prompts:
    """Token ids of prompts, per fact style and closing (the same ids in every mode)."""

    def __init__(self, tokenizer, convs):
        from inferscale.compose.prompt import PromptFormat, fact_token_ids

        self.tokenizer, self.convs = tokenizer, convs
        self.formats = {c: PromptFormat.from_tokenizer(tokenizer, INSTRUCTION, text) for c, text in CLOSINGS.items()}
        self.prefix = self.formats["none"].prefix_ids(tokenizer)
        self._facts: dict = {}
        self._wrappers: dict = {}
        self._fact_token_ids = fact_token_ids

    def fact(self, conv: str, index: int, style: str, wrappers: str = "") -> list[int]:
        """A fact's ids in the segment (with ``wrappers``: as stored, its wrapper positions filled)."""
        key = (conv, index, style)
        if key not in self._facts:
            self._facts[key] = self._fact_token_ids(self.tokenizer, self.convs[conv].all_facts()[index][0], style)
        if not wrappers:
            return self._facts[key]
        if wrappers not in self._wrappers:
            from inferscale.encode.wrappers import FactWrappers

            self._wrappers[wrappers] = FactWrappers.load(wrappers)
        return list(self._wrappers[wrappers].wrapped(self._facts[key]))

    def query(self, closing: str, question: str) -> list[int]:
        return self.formats[closing].query_ids(self.tokenizer, question)


def segment_order(retrieved: list[int], composer: str) -> list[int]:
    """Retrieved fact indices (best first) in segment order: the "relevance" composer's (the most
    relevant last) or the "stored" composer's (the order the facts were stored in)."""
    if composer == "stored":
        return sorted(retrieved)
    if composer == "relevance":
        return retrieved[::-1]
    raise ValueError(f"unknown composer order {composer!r}")


def request(method: Method, item: Item, k: int, prompts: Prompts, fact_ids: dict, nonce: str, salt_of,
            contexts: Contexts | None = None):
    """(prompt dict, kv_transfer_params or None) for one question; ``salt_of`` is :func:`cache_salts`',
    ``contexts`` what each fact was encoded behind (methods with ``contexts`` only)."""
    from inferscale.compose.request import make_params

    order = segment_order(item.retrieved[:k], method.order)
    segment = list(prompts.prefix)
    for j in order:
        segment += prompts.fact(item.conv, j, method.style, method.wrappers if method.mode == "kv" else "")
    ids = segment + prompts.query(method.closing, item.question)
    if method.mode == "prompt":
        return {"prompt_token_ids": ids, "cache_salt": f"text:{nonce}"}, None
    user = user_of(item.conv, method.encodings[0])
    if method.contexts:
        chosen = [contexts.choose(method, item.conv, j, set(order)) for j in order]
    else:
        chosen = [method.encoding_at(slot) for slot in range(len(order))]
    facts = [fact_ids[(item.conv, encoding)][j] for encoding, j in zip(chosen, order)]
    salt = salt_of(user, segment, method.recompute_tokens, method.key_scale)
    params = make_params(user, facts, method.recompute_tokens, method.key_scale)
    return {"prompt_token_ids": ids, "cache_salt": f"{salt}:{nonce}"}, params


def cache_salts(data_dir: Path):
    """``salt_of(user, segment, recompute_tokens, key_scale)``: the salt the connector reading
    ``data_dir`` expects (keyed with its secret, at the user's epoch)."""
    from inferscale.compose.salt import CacheSalts
    from inferscale.config import Config
    from inferscale.storage.disk import DiskStore

    config = Config(data_dir=str(data_dir))
    salts, disk = CacheSalts.from_file(config.secret_path), DiskStore(DiskStore.Options(root=str(config.kv_path)))
    return lambda user, segment, *recipe: salts.segment(user, disk.epoch(user), segment, *recipe)


def run_method(llm, method: Method, k: int, items, prompts, fact_ids, max_tokens: int, salt_of,
               contexts: Contexts | None = None) -> list[dict]:
    from inferscale.connector.compat import greedy_sampling

    nonce = uuid.uuid4().hex
    batch, sampling = [], []
    for item in items:
        prompt, params = request(method, item, k, prompts, fact_ids, nonce, salt_of, contexts)
        batch.append(prompt)
        sampling.append(greedy_sampling(max_tokens, params))
    outputs = llm.generate(batch, sampling, use_tqdm=False)
    rows = []
    for item, prompt, out in zip(items, batch, outputs):
        report = ((out.kv_transfer_params or {}).get("inferscale") or {}) if method.mode == "kv" else {}
        text = out.outputs[0].text.strip()
        rows.append({"conv": item.conv, "q": item.index, "k": k, "method": method.name, "answer": text,
                     "f1": f1(text, item.answer), "contains": contains(text, item.answer),
                     "prompt_tokens": len(prompt["prompt_token_ids"]),
                     "injected": report.get("injected_tokens", 0), "recomputed": report.get("recomputed_tokens", 0),
                     "fallback": report.get("fallback")})
    return rows


# ---------------------------------------------------------------- summary


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


# ---------------------------------------------------------------- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/data/locomo", help="folder of LoCoMo conversation files")
    parser.add_argument("--sample", type=int, default=0, help="stratified subsample of N questions (CPU smoke runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ks", default="5,10,20,50")
    parser.add_argument("--methods", default="grid", help="a set (grid, smoke, default) or names joined by ';'")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="HF directory or known model name")
    parser.add_argument("--dtype", default=None, help="serving dtype (default: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--embedder", default="minilm")
    parser.add_argument("--retrieval", default=None, help="retrieval cache (JSON): read if present, else written")
    parser.add_argument("--related", default=None, help="cache of each fact's nearest facts (JSON), as --retrieval")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--encode-batch", type=int, default=16)
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6, help="the engine's share of the GPU")
    parser.add_argument("--kv-cache-gib", type=float, default=0,
                        help="a KV cache of this size instead of one sized by a memory profile (GPU)")
    parser.add_argument("--time-limit", type=float, default=0, help="stop starting new methods after this many s")
    parser.add_argument("--default", default=None, help="the method the product serves by default (a name)")
    parser.add_argument("--baseline", default=None, help="the prompt-injection method it is held against")
    parser.add_argument("--out", default="benchmarks/results/locomo_accuracy.json")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from inferscale.encode.weights import model_dir as known_model_dir

    gpu = torch.cuda.is_available()
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    ks = [int(k) for k in args.ks.split(",")]
    methods = usable(select_methods(args.methods))
    model = args.model if os.path.isdir(args.model) else str(known_model_dir(args.model, args.dtype))
    convs, keys = load_items(args)
    retrieved = retrieve(convs, keys, max(50, *ks), Path(args.retrieval) if args.retrieval else None, args.embedder)
    items = make_items(convs, keys, retrieved, max(ks))
    recall_k = recall_at(items, convs, ks)
    print(f"{len(items)} questions from {len(convs)} conversations; recall@k: "
          + ", ".join(f"{k}: {v['all']:.3f}" for k, v in recall_k.items()), flush=True)

    from transformers import AutoTokenizer

    prompts = Prompts(AutoTokenizer.from_pretrained(model), convs)
    data_dir = Path(tempfile.mkdtemp(prefix="locomo-"))
    start = time.perf_counter()
    encodings = kv_encodings(methods)
    needed = needed_facts(items, max(ks))
    ranks = related_ranks(convs, Path(args.related) if args.related else None, args.embedder) \
        if any(e[2] for e in encodings) else {}
    fact_ids = encode_all(args, convs, needed, encodings, model, data_dir, prompts.prefix, getattr(torch, args.dtype),
                          ranks)
    encode_s = time.perf_counter() - start
    if gpu:
        torch.cuda.empty_cache()
    llm = build_engine(args, model, data_dir)
    salt_of = cache_salts(data_dir)
    rows, timing = [], {}
    device = torch.cuda.get_device_name() if gpu else "cpu"
    meta = {"command": " ".join(["python", *sys.argv]), "device": device, "model": Path(model).name,
            "dtype": args.dtype, "instruction": INSTRUCTION, "closings": CLOSINGS, "ks": ks,
            "questions": len(items), "facts": sum(len(c.all_facts()) for c in convs.values()),
            "conversations": sorted(convs), "sample": args.sample, "seed": args.seed,
            "methods": [asdict(m) for m in methods], "encode_s": encode_s, "recall": recall_k,
            "default": args.default, "baseline": args.baseline}
    began, contexts = time.perf_counter(), Contexts(ranks)
    for method in methods:
        if args.time_limit and time.perf_counter() - began > args.time_limit:
            print(f"time limit reached: {method.name} and the methods after it were not run", flush=True)
            break
        for k in ks:
            start = time.perf_counter()
            rows += run_method(llm, method, k, items, prompts, fact_ids, args.max_tokens, salt_of, contexts)
            timing[f"{method.name}@{k}"] = time.perf_counter() - start
            s = summarize([r for r in rows if r["method"] == method.name and r["k"] == k], items)[method.name][str(k)]
            print(f"{method.name:44s} k={k:2d}  F1 {s['f1.all']:.3f}  contains {s['contains.all']:.3f}  "
                  f"recomputed {s['recomputed']:.0f}  fallbacks {s['fallbacks']}  ({timing[f'{method.name}@{k}']:.1f} s)",
                  flush=True)
        table = write_results(Path(args.out), meta, timing, rows, items, methods, ks)
    print("\n" + table, flush=True)
    os._exit(0)  # vLLM's engine threads can keep the interpreter alive


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


if __name__ == "__main__":
    main()
