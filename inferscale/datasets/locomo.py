"""LoCoMo conversations (snap-research/locomo): turns, extracted facts, QA.

The released files are not uniform, and every conversation must load:

* an observation (a ready-made fact) cites one turn (``"D3:4"``) or several,
  as a list (``["D15:3", "D15:5"]``) or one string (``"D22:10, D22:12"``);
  such a fact is encoded after the *latest* turn it cites;
* a question's evidence is a list of turn ids, some of them joined
  (``"D8:6; D9:17"``), misspelt (``"D:11:26"``) or pointing at no turn; the
  ids that name a turn are kept (for retrieval recall), the question always is.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from inferscale.encode.window import Turn

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
_TURN_ID = re.compile(r"D:?(\d+):(\d+)")


@dataclass(frozen=True)
class Question:
    question: str
    answer: str
    category: int
    evidence: tuple[str, ...]  # turn ids that exist in the conversation


@dataclass(frozen=True)
class Conversation:
    sample_id: str
    speakers: tuple[str, str]
    turns: list[Turn]
    facts: dict[str, list[tuple[str, str]]]  # speaker → [(fact text, source turn id)]
    questions: list[Question]
    #: fact text → every turn it cites (its source is the latest of them)
    cited: dict[str, tuple[str, ...]] | None = None

    def all_facts(self) -> list[tuple[str, str]]:
        """Both speakers' facts, in the order of the conversation's sessions."""
        return [f for speaker in self.speakers for f in self.facts.get(speaker, [])]


def turn_ids(value: object) -> list[str]:
    """The turn ids a LoCoMo reference names (a string, a list, or a joined string)."""
    items: Iterable = value if isinstance(value, (list, tuple)) else [value]
    return [f"D{a}:{b}" for item in items for a, b in _TURN_ID.findall(str(item))]


def _sessions(conv: dict) -> list[int]:
    return sorted(int(m.group(1)) for k in conv if (m := re.fullmatch(r"session_(\d+)", k)))


def _dated(text: str, when: str) -> str:
    """Facts keep the session's date: temporal questions need it."""
    return f"({when}) {text}" if when else text


def _latest(ids: Sequence[str], order: dict[str, int]) -> str | None:
    known = [i for i in ids if i in order]
    return max(known, key=order.__getitem__) if known else None


def load_conversation(path: str | os.PathLike, max_sessions: int | None = None) -> Conversation:
    """Read one LoCoMo file; ``max_sessions`` keeps the first sessions only (and
    the questions whose evidence lies in them). Category-5 questions have no
    gold answer and are dropped. A file that is not one is a ValueError naming it."""
    try:
        return _conversation(path, json.loads(Path(path).read_text()), max_sessions)
    except (KeyError, TypeError, AttributeError, IndexError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a LoCoMo conversation file ({type(exc).__name__}: {exc})") from None


def _conversation(path: str | os.PathLike, data: dict, max_sessions: int | None) -> Conversation:
    conv = data.get("conversation", data)  # the released files nest it; some copies are flat
    sessions = _sessions(conv)[:max_sessions]
    turns = [Turn(t["dia_id"], t["speaker"], t["text"]) for s in sessions for t in conv[f"session_{s}"]]
    order = {t.turn_id: i for i, t in enumerate(turns)}
    speakers = (conv["speaker_a"], conv["speaker_b"])
    facts: dict[str, list[tuple[str, str]]] = {name: [] for name in speakers}
    cited: dict[str, tuple[str, ...]] = {}
    for s in sessions:
        observations = data.get("observation", data).get(f"session_{s}_observation") or {}
        when = conv.get(f"session_{s}_date_time", "")
        for speaker, items in observations.items():
            for text, source in items:
                ids = turn_ids(source)
                latest = _latest(ids, order)
                if latest is None:
                    raise ValueError(f"{path}: observation {text[:40]!r} cites no known turn ({source!r})")
                dated = _dated(text, when)
                facts.setdefault(speaker, []).append((dated, latest))
                cited[dated] = tuple(dict.fromkeys(cited.get(dated, ()) + tuple(i for i in ids if i in order)))
    questions = _questions(data.get("qa", []), order, limited=max_sessions is not None)
    return Conversation(data.get("sample_id", Path(path).stem), speakers, turns, facts, questions, cited)


def _questions(qa: list[dict], order: dict[str, int], limited: bool) -> list[Question]:
    out = []
    for q in qa:
        if int(q["category"]) == 5 or "answer" not in q:
            continue
        raw = turn_ids(q.get("evidence", ()))
        known = tuple(dict.fromkeys(i for i in raw if i in order))
        if limited and len(known) < len(raw):
            continue  # evidence beyond the sessions kept
        out.append(Question(q["question"], str(q["answer"]), int(q["category"]), known))
    return out


def load_all(directory: str | os.PathLike) -> list[Conversation]:
    """Every ``*.json`` conversation in a directory, sorted by file name."""
    paths = sorted(Path(directory).glob("*.json"))
    if not paths:
        raise FileNotFoundError(f"no LoCoMo conversations (*.json) in {directory}")
    return [load_conversation(p) for p in paths]


def stratified_sample(items: Sequence, n: int, key, seed: int = 0) -> list:
    """Exactly ``n`` items drawn with a fixed seed, each stratum (``key(item)``) in
    proportion (largest remainders; at least one item per stratum while ``n``
    allows), in their original order."""
    if n >= len(items):
        return list(items)
    strata: dict = defaultdict(list)
    for i, item in enumerate(items):
        strata[key(item)].append(i)
    names = sorted(strata, key=str)
    shares = {k: n * len(strata[k]) / len(items) for k in names}
    quota = {k: min(len(strata[k]), max(1, int(shares[k]))) for k in names}
    by_remainder = sorted(names, key=lambda k: shares[k] - int(shares[k]), reverse=True)
    while sum(quota.values()) < n:
        for k in by_remainder:
            if sum(quota.values()) < n and quota[k] < len(strata[k]):
                quota[k] += 1
    while sum(quota.values()) > n:
        quota[max(names, key=lambda k: quota[k])] -= 1
    rng = random.Random(seed)
    chosen = [i for k in names for i in rng.sample(strata[k], quota[k])]
    return [items[i] for i in sorted(chosen)]
