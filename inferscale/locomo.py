"""LoCoMo conversations (snap-research/locomo): turns, extracted facts, QA."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from inferscale.encode.window import Turn

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}


@dataclass(frozen=True)
class Question:
    question: str
    answer: str
    category: int
    evidence: tuple[str, ...]


@dataclass(frozen=True)
class Conversation:
    sample_id: str
    speakers: tuple[str, str]
    turns: list[Turn]
    facts: dict[str, list[tuple[str, str]]]  # speaker → [(fact text, source turn id)]
    questions: list[Question]


def _sessions(conv: dict) -> list[int]:
    return sorted(int(m.group(1)) for k in conv if (m := re.fullmatch(r"session_(\d+)", k)))


def _dated(text: str, when: str) -> str:
    """Facts keep the session's date: temporal questions need it."""
    return f"({when}) {text}" if when else text


def load_conversation(path: str | os.PathLike, max_sessions: int | None = None) -> Conversation:
    """Read one LoCoMo file; ``max_sessions`` keeps the first sessions only (and
    the questions whose evidence lies in them). Category-5 questions have no
    gold answer and are dropped."""
    data = json.loads(Path(path).read_text())
    conv = data.get("conversation", data)  # the released files nest it; some copies are flat
    sessions = _sessions(conv)[:max_sessions]
    turns = [Turn(t["dia_id"], t["speaker"], t["text"]) for s in sessions for t in conv[f"session_{s}"]]
    speakers = (conv["speaker_a"], conv["speaker_b"])
    facts: dict[str, list[tuple[str, str]]] = {name: [] for name in speakers}
    for s in sessions:
        observations = data.get("observation", data).get(f"session_{s}_observation") or {}
        when = conv.get(f"session_{s}_date_time", "")
        for speaker, items in observations.items():
            facts.setdefault(speaker, []).extend((_dated(text, when), str(source)) for text, source in items)
    known = {t.turn_id for t in turns}
    questions = [
        Question(q["question"], str(q["answer"]), int(q["category"]), tuple(q.get("evidence", ())))
        for q in data.get("qa", [])
        if int(q["category"]) != 5 and "answer" in q and set(q.get("evidence", ())) <= known
    ]
    return Conversation(data.get("sample_id", Path(path).stem), speakers, turns, facts, questions)
