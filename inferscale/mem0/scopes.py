"""Which retriever users hold a memory of a given user, agent, run or actor: what narrows a search.

Qdrant indexes Mem0's scope fields (``user_id``, ``agent_id``, ``run_id``, ``actor_id``) so that
an equality on them does not scan the collection; here the same equalities (and ``in``) pick the
retriever users a search or a listing visits (:func:`~inferscale.mem0.filters.narrowed`), before
any payload is read. A memory is indexed under its ``user_id``, so a user's filter visits that user
alone; an agent's memories without a user (under ``_shared``) are found the same way.
"""

from __future__ import annotations

from collections import Counter, defaultdict

SCOPE_FIELDS = ("user_id", "agent_id", "run_id", "actor_id")


class Scopes:
    """For each scope field and string value, the retriever users holding memories with it (counted)."""

    def __init__(self):
        self._held: dict[str, defaultdict[str, Counter]] = {f: defaultdict(Counter) for f in SCOPE_FIELDS}
        #: users holding a value that is not a string (a number, a list): visited for any value of the field
        self._other: dict[str, Counter] = {f: Counter() for f in SCOPE_FIELDS}

    def add(self, user: str, payload: dict, count: int = 1) -> None:
        for field in SCOPE_FIELDS:
            value = payload.get(field)
            if value is None:  # absent or null: no equality selects it
                continue
            held = self._held[field][value] if isinstance(value, str) else self._other[field]
            held[user] += count
            if held[user] <= 0:
                del held[user]
                if isinstance(value, str) and not held:
                    del self._held[field][value]

    def remove(self, user: str, payload: dict) -> None:
        self.add(user, payload, -1)

    def users(self, field: str, values: frozenset) -> set[str] | None:
        """The users an exact match on ``field`` (tagged values, as in
        :class:`~inferscale.mem0.filters.Condition`) can select; ``None`` for a field not indexed."""
        if field not in self._held:
            return None
        found = set(self._other[field])
        for kind, value in values:
            if kind == "str" and value in self._held[field]:
                found.update(self._held[field][value])
        return found

    def clear(self) -> None:
        self.__init__()
