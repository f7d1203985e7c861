"""The Fact record: one remembered statement about a user.

A fact links three things under one ``fact_id``: its text (embedded for
retrieval), its token ids, and its K/V (stored by a KV store).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


@dataclass(frozen=True)
class Fact:
    fact_id: str
    user_id: str
    text: str
    source_turn: str | None = None
    token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        check_id(self.fact_id, "fact_id")
        check_id(self.user_id, "user_id")
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))


@dataclass(frozen=True)
class Hit:
    """A retrieved fact and how relevant it is (higher is more relevant)."""

    fact_id: str
    score: float


def make_fact_id(user_id: str, text: str, source_turn: str | None = None) -> str:
    """A stable id: the same user, text and source turn always give the same id,
    so re-adding a conversation is idempotent."""
    digest = hashlib.sha256(f"{user_id}\x00{source_turn or ''}\x00{text}".encode()).hexdigest()
    return f"f-{digest[:16]}"


def check_id(value: object, what: str) -> str:
    """user_ids and fact_ids are short ASCII names (they become file and tensor names)."""
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise ValueError(f"{what} must match {_ID_RE.pattern}, got {value!r}")
    return value


def render_fact(text: str, style: str = "bullet") -> str:
    """How a fact reads inside the memory segment: one line, as a bullet
    (``style="bullet"``) or as a plain sentence (``style="line"``).

    Encoder, composer and the prompt-injection baseline all use this, so KV
    injection and text injection put exactly the same tokens before the query.
    """
    line = " ".join(text.split())
    if style == "bullet":
        return f"- {line}\n"
    if style == "line":
        return f"{line}\n"
    raise ValueError(f"unknown fact style {style!r} (bullet, line)")
