"""Mem0's filter language, evaluated on payloads with the results Mem0's Qdrant store gives.

Mem0 (2.2.1) hands a store's ``search`` and ``list`` the filters its user wrote (``search``
first flattens ``AND`` trees and adds ``$or``/``$not`` copies), and each store translates them.
This module reads them as Mem0's Qdrant store does (``mem0/vector_stores/qdrant.py``):

* ``{"key": value}`` is equality, a list value is ``in``, and ``"*"`` matches anything (the key
  drops out of the filter, so a memory without the key passes too);
* ``{"key": {op: value}}`` with one of ``eq``, ``ne``, ``in``, ``nin``, ``icontains``,
  ``contains`` (the first of that order when several are given), or bounds ``gt``, ``gte``,
  ``lt``, ``lte``, alone or together but with no other operator; bounds that are all ISO dates
  compare as dates, others as numbers;
* ``AND``, ``OR``, ``NOT`` (or ``$and``, ``$or``, ``$not``: the first spelling met is used)
  take a list of filters; one that drops out whole (wildcards only) is left out of its list;
* sibling keys are ANDed; an empty filter, or one of wildcards only, matches everything.

Values are checked as Qdrant's request models check them (``eq``, ``ne``: a string, an integer or
a boolean; ``in``/``nin``: strings only or integers only; bounds: numbers or ISO dates;
``contains``: a string), with a ``ValueError`` naming the key where Qdrant refuses the filter. One
difference: ``{"ne": True}``, in Mem0's docs, is refused by Qdrant and selects here what is not
``true`` (and not missing or ``null``, as for any ``ne``).
What each condition selects is :mod:`~inferscale.mem0.payload_values`'.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from datetime import date, datetime, time, timezone
from typing import Any

from inferscale.mem0.payload_values import parse_date, parse_path, path_values, tagged, words

WILDCARD = "*"
_MISSING = object()
#: a payload value's type → the tag :func:`~inferscale.mem0.payload_values.tagged` gives it
_TAGS = {bool: "bool", int: "int", str: "str"}
LOGICAL = {"AND": "AND", "OR": "OR", "NOT": "NOT", "$and": "AND", "$or": "OR", "$not": "NOT"}
BOUNDS = {"gt": operator.gt, "gte": operator.ge, "lt": operator.lt, "lte": operator.le}
MATCHES = ("eq", "ne", "in", "nin", "icontains", "contains")
#: bound values that make a date range (Mem0's test; Qdrant then parses them)
_ISO_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2})?(\.\d+)?(Z|[+-]\d{2}:?\d{2})?)?$")


@dataclass(frozen=True)
class Condition:
    """One key's test: it holds when one of the values the key's path selects passes ``test``."""

    key: str
    test: Callable[[Any], bool]
    #: the values an exact match (``eq``, ``in``) selects, tagged with their type; ``None`` for other tests
    exact: frozenset | None = None
    path: tuple = field(init=False)
    #: the key, when the path is that one top-level key (the common case, read without walking a path)
    top: str | None = field(init=False)

    def __post_init__(self):
        path = parse_path(self.key)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "top", path[0] if len(path) == 1 and isinstance(path[0], str) else None)

    def matches(self, payload: dict) -> bool:
        if self.top is None:
            return any(map(self.test, path_values(payload, self.path)))
        value = payload.get(self.top, _MISSING)
        if type(value) is list:
            return any(map(self.test, value))
        return value is not _MISSING and self.test(value)


@dataclass(frozen=True)
class Filter:
    """All of ``must``, none of ``must_not``, and one of ``should`` if it has any (Qdrant's filter)."""

    must: tuple = ()
    should: tuple = ()
    must_not: tuple = ()

    def matches(self, payload: dict) -> bool:
        for condition in self.must:
            if not condition.matches(payload):
                return False
        for condition in self.must_not:
            if condition.matches(payload):
                return False
        return not self.should or any(c.matches(payload) for c in self.should)


def compile_filters(filters: Mapping[str, Any] | None) -> Filter | None:
    """Mem0 filters as a :class:`Filter`; ``None`` when they select everything."""
    if not filters:
        return None
    if not isinstance(filters, dict):
        raise ValueError(f"filters must be a dict of keys and conditions, got {type(filters).__name__}")
    spelled: dict = {}
    for key, value in filters.items():
        spelled.setdefault(LOGICAL.get(key, key), value)
    parts: dict[str, list] = {"AND": [], "OR": [], "NOT": []}
    for key, value in spelled.items():
        if key in parts:
            parts[key] += [f for f in map(compile_filters, _members(key, value)) if f is not None]
        elif (condition := _condition(key, value)) is not None:
            parts["AND"].append(condition)
    if not any(parts.values()):
        return None
    return Filter(tuple(parts["AND"]), tuple(parts["OR"]), tuple(parts["NOT"]))


def narrowed(where: Filter, lookup: Callable[[str, frozenset], set | None]) -> set | None:
    """At most which users ``where`` can select, from its exact matches: ``lookup(key, tagged values)``
    names the users holding one of the values under a key (``None``: the key is not looked up);
    ``None`` when the filter does not narrow the users."""
    found = None
    for condition in where.must:
        found = _meet(found, _narrowed(condition, lookup))
    if where.should:
        alternatives = [_narrowed(condition, lookup) for condition in where.should]
        if all(a is not None for a in alternatives):
            found = _meet(found, set().union(*alternatives))
    return found


def without_user_equalities(where: Filter) -> Filter | None:
    """``where`` less its top-level equalities (and ``in``) on ``user_id``; ``None`` if nothing is left.
    For the users :func:`narrowed` names, whose memories all pass them."""
    must = tuple(c for c in where.must if not (isinstance(c, Condition) and c.exact is not None
                                               and c.path == ("user_id",) and c.key == "user_id"))
    return Filter(must, where.should, where.must_not) if must or where.should or where.must_not else None


def _narrowed(condition: Condition | Filter, lookup: Callable) -> set | None:
    if isinstance(condition, Filter):
        return narrowed(condition, lookup)
    if condition.exact is None or condition.path != (condition.key,):
        return None
    return lookup(condition.key, condition.exact)


def _meet(found: set | None, more: set | None) -> set | None:
    return more if found is None else found if more is None else found & more


def _members(key: str, value: Any) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{key} filter value must be a list of filter dicts, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ValueError(f"{key} filter list item at index {i} must be a dict, got {type(item).__name__}: {item!r}")
    return value


def _condition(key: Any, value: Any) -> Condition | None:
    if not isinstance(key, str):
        raise ValueError(f"filter keys are strings, got {key!r}")
    if not isinstance(value, dict):
        if isinstance(value, str) and value == WILDCARD:
            return None
        return _one_of(key, value, "in") if isinstance(value, list) else _one_of(key, [value], "eq")
    operators = set(value)
    bounds = operators & set(BOUNDS)
    if bounds and operators - bounds:
        raise ValueError(f"Cannot mix range operators ({sorted(bounds)}) with non-range operators "
                         f"({sorted(map(str, operators - bounds))}) for field {key!r}: combine them with AND")
    if bounds:
        return _range(key, {op: value[op] for op in BOUNDS if op in value})
    op = next((op for op in MATCHES if op in value), None)
    if op is None:
        raise ValueError(f"Unsupported filter operator(s) for field {key!r}: {sorted(map(str, operators))}; "
                         f"supported: {', '.join([*MATCHES, *BOUNDS])}")
    if op in ("icontains", "contains"):
        return _text(key, value[op], op)
    if op in ("ne", "nin"):
        return _none_of(key, [value[op]] if op == "ne" else value[op], op)
    return _one_of(key, [value[op]] if op == "eq" else value[op], op)


def _one_of(key: str, values: Any, op: str) -> Condition:
    wanted = _exact_values(key, values, op)
    by_type = _by_type(wanted)
    return Condition(key, lambda v: v in by_type.get(type(v), ()), wanted)


def _none_of(key: str, values: Any, op: str) -> Condition:
    by_type = _by_type(_exact_values(key, values, op))
    return Condition(key, lambda v: v is not None and v not in by_type.get(type(v), ()))


def _by_type(values: frozenset) -> dict[type, set]:
    """Tagged values as a set per payload type (a JSON value's type is exactly one of these)."""
    return {kind: {v for tag, v in values if tag == name} for kind, name in _TAGS.items()}


def _exact_values(key: str, values: Any, op: str) -> frozenset:
    """Qdrant's rules: ``eq`` takes a string, an integer or a boolean; ``in`` and ``nin`` a list of
    strings only or integers only. ``ne`` takes what ``eq`` takes: Qdrant refuses a boolean there
    (its ``except`` list holds strings or integers), but Mem0's docs show ``{"ne": True}``."""
    if op in ("in", "nin") and not isinstance(values, (list, tuple, set, frozenset)):
        raise ValueError(f"filter on {key!r}: {op} takes a list of strings or of integers, got {values!r}")
    found = [tagged(v) for v in values]
    kinds = {t[0] if t else None for t in found}
    allowed = ({"bool"}, {"int"}, {"str"}) if op in ("eq", "ne") else ({"int"}, {"str"})
    if found and kinds not in allowed:
        what = "a string, an integer or a boolean" if op in ("eq", "ne") else "strings only or integers only"
        raise ValueError(f"filter on {key!r}: {op} takes {what}, got {list(values)!r}")
    return frozenset(found)


def _text(key: str, text: Any, op: str) -> Condition:
    if not isinstance(text, str):
        raise ValueError(f"filter on {key!r}: {op} takes a string, got {text!r}")
    wanted = set(words(text))
    return Condition(key, lambda v: bool(wanted) and isinstance(v, str) and wanted <= set(words(v)))


def _range(key: str, bounds: dict) -> Condition:
    if all(isinstance(v, str) and _ISO_DATE.match(v) for v in bounds.values()):
        limits = [(BOUNDS[op], _date_bound(key, v)) for op, v in bounds.items()]
        return Condition(key, lambda v: _within_dates(v, limits))
    limits = [(BOUNDS[op], b) for op, v in bounds.items() if (b := _number_bound(key, op, v)) is not None]
    return Condition(key, lambda v: _within(v, limits))


def _within(value: Any, limits: list) -> bool:
    if type(value) is not int and type(value) is not float:  # not a bool either, as on Qdrant
        return False
    for compare, bound in limits:
        if not compare(value, bound):
            return False
    return True


def _within_dates(value: Any, limits: list) -> bool:
    moment = parse_date(value) if isinstance(value, str) else None
    return moment is not None and all(c(moment, b) for c, b in limits)


def _number_bound(key: str, op: str, value: Any) -> float | None:
    """A bound as Qdrant's ``Range`` reads it (a number, a numeric string, a boolean, or ``None``: no bound)."""
    from pydantic import ValidationError

    try:
        return _reader(float | None).validate_python(value)
    except ValidationError:
        raise ValueError(f"filter on {key!r}: {op} takes a number or an ISO date, got {value!r}") from None


def _date_bound(key: str, value: str) -> datetime:
    """A date bound as Qdrant's ``DatetimeRange`` reads it, UTC when it names no zone."""
    from pydantic import ValidationError

    try:
        moment = _reader(datetime | date).validate_python(value)
    except ValidationError as exc:
        raise ValueError(f"Invalid datetime value in range filter for field {key!r}: {value!r} "
                         f"({exc.errors()[0]['msg']})") from None
    if not isinstance(moment, datetime):
        moment = datetime.combine(moment, time())
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


@cache
def _reader(kind: Any) -> Any:
    """A pydantic reader of ``kind``: Qdrant's request models read their fields with pydantic."""
    from pydantic import TypeAdapter

    return TypeAdapter(kind)
