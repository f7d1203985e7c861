"""A payload's values as Qdrant reads them, so a filter here selects what it selects on Qdrant.

Mem0's default store is Qdrant, and a Mem0 user's filters mean what Qdrant makes of them
(qdrant-client's local mode is the reference: it mirrors the server without payload indexes):

* a key is a path (``"a.b"``, ``"tags[]"``, ``"tags[0]"``, ``'"a.b"'`` for a key holding a dot);
  a list it ends on stands for its elements, one level deep;
* an exact match compares like JSON types (``True`` is not ``1``) and never selects a float;
* a text match (``contains``) wants every word of the query among the value's words, case
  ignored, words being runs of letters and digits;
* a date range reads the value with the formats Qdrant accepts, UTC when it names no zone.

Payloads are kept as JSON values (:func:`jsonable`, as Qdrant converts them on write).
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from typing import Any

#: a path step that takes every element of a list (``[]``)
EVERY = None
_STEP = re.compile(r'(?:"([^"]*)"|([\w-]+))((?:\[[0-9]*\])*)')
_INDEX = re.compile(r"\[([0-9]*)\]")
_WORD = re.compile(r"[^\W_]+")
#: the date formats Qdrant reads a payload value with (its ``datetime_utils``)
_DATE_FORMATS = [f"%Y-%m-%d{sep}%H:%M:%S{fraction}{zone}" for zone in ("%z", " %z", "") for fraction in (".%f", "")
                 for sep in ("T", " ")] + ["%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M", "%Y-%m-%d"]


def parse_path(key: str) -> tuple:
    """A filter key as path steps (``str`` keys, ``int`` indexes, :data:`EVERY`); ``ValueError`` if it is none."""
    steps: list = []
    position = 0
    while position < len(key):
        match = _STEP.match(key, position)
        if match is None:
            raise ValueError(f"filter key {key!r} is not a payload path (keys of letters, digits, '_' "
                             "and '-', joined by '.', each optionally followed by [] or [n])")
        steps.append(match.group(1) if match.group(1) is not None else match.group(2))
        steps += [EVERY if i == "" else int(i) for i in _INDEX.findall(match.group(3))]
        position = match.end()
        if position < len(key) and (key[position] != "." or position + 1 == len(key)):
            raise ValueError(f"filter key {key!r} is not a payload path (steps are joined by '.')")
        position += 1
    return tuple(steps)


def path_values(payload: Any, path: tuple) -> list:
    """The values ``path`` selects in ``payload`` (a list selected is its elements)."""
    if len(path) == 1 and isinstance(payload, dict):  # the common case: a top-level key
        if path[0] not in payload:
            return []
        value = payload[path[0]]
        return value if isinstance(value, list) else [value]
    found: list = []
    _walk(payload, path, found)
    return found


def _walk(data: Any, path: tuple, found: list) -> None:
    if not path:
        found.extend(data) if isinstance(data, list) else found.append(data)
        return
    step, rest = path[0], path[1:]
    if isinstance(step, str):
        if isinstance(data, dict) and step in data:
            _walk(data[step], rest, found)
    elif isinstance(data, list):
        for item in data if step is EVERY else data[step:step + 1]:
            _walk(item, rest, found)


def tagged(value: Any) -> tuple | None:
    """What an exact match compares: the value with its JSON type (``True`` is not ``1``); ``None``
    for a value no exact match selects (a float, ``null``, a list, an object)."""
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, str):
        return ("str", value)
    return None


def words(text: str) -> list[str]:
    """A text's words for ``contains``: runs of letters and digits, lowercased."""
    return [w.lower() for w in _WORD.findall(text)]


def parse_date(value: str) -> datetime | None:
    """A payload value read as a date the way Qdrant reads it (UTC when it names no zone), or ``None``."""
    text = _normalized_date(value)
    for candidate in (text, text + ":00") if _hour_offset(text) else (text,):
        for fmt in _DATE_FORMATS:
            try:
                parsed = datetime.strptime(candidate, fmt)
            except ValueError:
                continue
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)
    return None


def _normalized_date(text: str) -> str:
    """Qdrant's leniencies: leading blanks, `` UTC``, a lowercase ``z``, more than 6 fraction digits."""
    text = text.lstrip()
    if text.endswith(" UTC"):
        text = text[:-4] + "+00:00"
    elif text.endswith("z"):
        text = text[:-1] + "Z"
    dot = text.find(".")
    if dot != -1:
        end = dot + 1
        while end < len(text) and text[end].isdigit():
            end += 1
        if end - dot > 7:
            text = text[:dot + 7] + text[end:]
    return text


def _hour_offset(text: str) -> bool:
    """Whether the text ends in an offset of hours only (``+01``), which ``strptime`` reads with ``:00`` added."""
    tail = text[-3:]
    return len(tail) == 3 and tail[0] in "+-" and tail[1:].isdigit()


def jsonable(payload: Any) -> dict:
    """The payload as JSON values, as Qdrant stores it (dates as ISO text, tuples as lists);
    ``ValueError`` for a value JSON cannot hold."""
    from pydantic_core import to_jsonable_python

    try:
        converted = json.loads(json.dumps(payload if payload is not None else {}, allow_nan=True,
                                          default=to_jsonable_python))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a payload must be JSON: {exc}") from None
    if not isinstance(converted, dict):
        raise ValueError(f"a payload must be a JSON object (a dict), got {type(payload).__name__}")
    return converted
