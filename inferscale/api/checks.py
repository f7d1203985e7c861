"""What the Python API checks as a call enters, before it does any work.

A mistake gets a clear error at the call that made it, never a surprise later: a user id in
NFC (:func:`inferscale.facts.check_user_id`: ``"josé"`` typed composed or decomposed is one
user), facts as a list (a plain string would be stored a character per fact), each with some
text, ``k`` a positive integer, a mode the API has.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from inferscale.compose.request import MAX_FACTS
from inferscale.facts import check_user_id, shown

MODES = ("kv", "prompt", "none")
Method = TypeVar("Method", bound=Callable[..., Any])


def user_call(method: Method) -> Method:
    """The method's first argument, ``user_id``, checked and normalized (NFC) before the call."""

    @functools.wraps(method)
    def checked(self, user_id, *args, **kwargs):
        return method(self, check_user_id(user_id), *args, **kwargs)

    return checked  # type: ignore[return-value]


def fact_inputs(facts: object) -> list[tuple[str, str | None]]:
    """Facts as ``(text, turn_id or None)``: a list (or other sequence) of strings or pairs."""
    if isinstance(facts, (str, bytes)) or not hasattr(facts, "__iter__") or isinstance(facts, dict):
        raise TypeError(f"facts must be a list of strings or (text, turn_id) pairs, got {shown(facts)}"
                        f"{' (a plain string: wrap it in a list)' if isinstance(facts, str) else ''}")
    return [_fact(item) for item in facts]


def _fact(item: object) -> tuple[str, str | None]:
    text, turn = (item, None) if isinstance(item, str) else _pair(item)
    fact_text(text)
    if turn is not None and not isinstance(turn, str):
        raise TypeError(f"a fact's turn_id must be a string or None, got {shown(turn)}")
    return text, turn


def _pair(item: object) -> tuple[object, object]:
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1]
    raise TypeError(f"a fact must be a string or a (text, turn_id) pair, got {shown(item)}")


def fact_text(text: object) -> str:
    if not isinstance(text, str):
        raise TypeError(f"a fact's text must be a string, got {shown(text)}")
    if not text.strip():
        raise ValueError(f"a fact must hold some text, got {shown(text)}")
    return text


def top_k(k: object) -> int | None:
    """None (the config's ``top_k``) or an integer in 1..:data:`MAX_FACTS`."""
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_FACTS:
        raise ValueError(f"k must be an integer in 1..{MAX_FACTS} (or None: the config's top_k), got {shown(k)}")
    return k


def mode(value: object) -> str:
    if value not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {shown(value)}")
    return value  # type: ignore[return-value]
