"""How an answer is scored: LoCoMo's token F1 and containment against the gold answer, and the
recall of a question's evidence turns by the retrieved facts."""

from __future__ import annotations

import re
import string
from collections import Counter


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
