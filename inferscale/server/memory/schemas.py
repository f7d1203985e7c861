"""The memory endpoints' request bodies and answers (JSON), validated by pydantic.

Mem0's API in spirit: memories belong to a ``user_id`` (in the body or the
query, never in the path, so any id Mem0 accepts travels as it is), and a
memory is one fact: ``{"id", "user_id", "text", "source_turn", "tokens"}``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from inferscale.api import MAX_FACTS
from inferscale.facts import MAX_USER_ID_CHARS, Fact, check_request_user_id, shown

MAX_FACT_CHARS = 2_000
MAX_FACTS_PER_CALL = 256
#: the characters of one call's facts together (a call's encoding is bounded, whatever its facts)
MAX_FACT_CHARS_PER_CALL = 100_000
MAX_MESSAGES = 200
MAX_MESSAGE_CHARS = 20_000
#: the characters of one call's messages together (with the facts', what bounds the body: server/limits.py)
MAX_MESSAGE_CHARS_PER_CALL = 200_000
MAX_QUERY_CHARS = 4_000


def k_of(value: object, name: str = "k", most: int = MAX_FACTS) -> int | None:
    """How many facts to retrieve, as chat and search take it: None (the config's ``top_k``) or
    a JSON integer in 1..``most``; never a string (``"3"``) or a boolean."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise ValueError(f"{name} must be an integer in 1..{most}, got {shown(value)}")
    return value


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _UserBody(_Body):
    user_id: str = Field(max_length=MAX_USER_ID_CHARS)  # checked before anything walks the id

    @field_validator("user_id")
    @classmethod
    def _user(cls, value: str) -> str:
        return check_request_user_id(value)


def _some_text(value: str) -> str:
    if not value.strip():
        raise ValueError("a fact must hold some text, not only whitespace")
    return value


class FactIn(_Body):
    text: str = Field(min_length=1, max_length=MAX_FACT_CHARS)
    source_turn: str | None = Field(None, max_length=128)

    _text = field_validator("text")(_some_text)


class MessageIn(_Body):
    role: Literal["user", "assistant"]
    content: str = Field(max_length=MAX_MESSAGE_CHARS)
    turn_id: str | None = Field(None, max_length=128)


class AddMemories(_UserBody):
    """Given ``facts`` are stored as they are (``messages``, if any, are their context);
    ``messages`` alone go through Mem0's extraction on the served model."""

    facts: list[FactIn | str] | None = Field(None, min_length=1, max_length=MAX_FACTS_PER_CALL)
    messages: list[MessageIn] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)

    @field_validator("facts")
    @classmethod
    def _facts(cls, value):
        if value is None:
            return value
        total = sum(len(item if isinstance(item, str) else item.text) for item in value)
        if total > MAX_FACT_CHARS_PER_CALL:
            raise ValueError(f"the facts hold {total:,} characters together (at most {MAX_FACT_CHARS_PER_CALL:,} "
                             f"per call: send more calls)")
        for item in value:
            if isinstance(item, str) and not 0 < len(item) <= MAX_FACT_CHARS:
                raise ValueError(f"a fact must have 1..{MAX_FACT_CHARS} characters")
            if isinstance(item, str):
                _some_text(item)
            if isinstance(item, str) and not item.isascii():
                try:
                    item.encode()
                except UnicodeEncodeError:  # pydantic lets a lone surrogate through a str in a union
                    raise ValueError("a fact holds a lone UTF-16 surrogate, which is not text") from None
        return value


    @field_validator("messages")
    @classmethod
    def _messages(cls, value):
        total = sum(len(m.content) for m in value or ())
        if total > MAX_MESSAGE_CHARS_PER_CALL:
            raise ValueError(f"the messages hold {total:,} characters together (at most "
                             f"{MAX_MESSAGE_CHARS_PER_CALL:,} per call: send more calls)")
        return value


class SearchMemories(_UserBody):
    query: str = Field(min_length=1, max_length=MAX_QUERY_CHARS)
    k: int | None = None

    @field_validator("k", mode="before")
    @classmethod
    def _k(cls, value: object) -> int | None:
        return k_of(value)


class UpdateMemory(_UserBody):
    text: str = Field(min_length=1, max_length=MAX_FACT_CHARS)

    _text = field_validator("text")(_some_text)


def fact_json(fact: Fact, score: float | None = None) -> dict:
    out = {"id": fact.fact_id, "user_id": fact.user_id, "text": fact.text, "source_turn": fact.source_turn,
           "tokens": len(fact.token_ids)}
    if score is not None:
        out["score"] = round(float(score), 6)
    return out
