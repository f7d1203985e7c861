"""Mem0's filter language in the "inferscale" provider selects what Mem0's Qdrant store selects.

The reference is Mem0 2.2.1's own translation (``mem0.vector_stores.qdrant.Qdrant._create_filter``)
evaluated by qdrant-client's local mode (``check_filter``), the store Mem0 uses by default: random
payloads and random filters (every operator, wildcards, nesting, bad values) must give the same
selection, or both refuse the filter. The forms of Mem0's docs and of its Qdrant tests are checked
by name as well.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from inferscale.mem0.filters import compile_filters, narrowed
from inferscale.mem0.payload_values import parse_path

qdrant_store = pytest.importorskip("mem0.vector_stores.qdrant")
payload_filters = pytest.importorskip("qdrant_client.local.payload_filters")

KEYS = ["category", "priority", "score", "tags", "status", "created_at", "user_id", "flag", "meta.level", "tags[]",
        "tags[0]", "absent"]
WORDS = ["work", "Work", "meeting", "python", "rust", "urgent", "today", "*", "", "prog", "data"]
DATES = ["2025-01-01", "2025-01-01T00:00:00Z", "2025-06-15T10:30:00+05:30", "2025-06-15 10:30:00",
         "2025-12-31T23:59:59.123456789Z", "2026-02-01T08:00:00-08:00", "2025-02-01T09:15", "not a date",
         "2025-13-45", "2025-03-01T12:00:00+01"]
scalars = st.one_of(st.sampled_from(WORDS), st.integers(-3, 12), st.sampled_from([0.5, 1.0, 9.5, -1.5]),
                    st.booleans(), st.none(), st.sampled_from(DATES),
                    st.lists(st.sampled_from(WORDS[:6]), max_size=3).map(" ".join))
payload_values = st.one_of(scalars, st.lists(scalars, max_size=3))
payloads = st.dictionaries(st.sampled_from(["category", "priority", "score", "tags", "status", "created_at",
                                            "user_id", "flag"]), payload_values, max_size=7).flatmap(
    lambda p: st.one_of(st.just(p), st.builds(lambda lvl: {**p, "meta": {"level": lvl}}, payload_values)))

operand_lists = st.lists(st.one_of(st.sampled_from(WORDS), st.integers(-3, 12)), max_size=3) | \
    st.lists(st.sampled_from(WORDS), max_size=3) | st.lists(st.integers(-3, 12), max_size=3) | \
    st.lists(st.booleans(), min_size=1, max_size=2) | st.sampled_from(["work", 3, None])
bounds = st.one_of(st.integers(-3, 12), st.sampled_from([0.5, 9.5, "5", True, None, "abc"]), st.sampled_from(DATES))
operators = st.one_of(
    st.builds(lambda op, v: {op: v}, st.sampled_from(["eq", "ne"]), scalars),
    st.builds(lambda op, v: {op: v}, st.sampled_from(["in", "nin"]), operand_lists),
    st.builds(lambda op, v: {op: v}, st.sampled_from(["contains", "icontains"]),
              st.one_of(st.sampled_from(WORDS), st.lists(st.sampled_from(WORDS), max_size=3).map(" ".join),
                        st.integers(0, 3))),
    st.dictionaries(st.sampled_from(["gt", "gte", "lt", "lte"]), bounds, min_size=1, max_size=2),
    st.dictionaries(st.sampled_from(["gt", "eq", "ne", "in", "contains", "icontains", "like"]), scalars, max_size=2),
)
conditions = st.one_of(scalars, st.just("*"), st.lists(st.sampled_from(WORDS), max_size=3),
                       st.lists(st.integers(-3, 12), max_size=3), operators)
leaf_filters = st.dictionaries(st.sampled_from(KEYS), conditions, min_size=1, max_size=3)
LOGICAL = ["AND", "OR", "NOT", "$and", "$or", "$not"]
filters = st.recursive(
    leaf_filters,
    lambda inner: st.one_of(
        st.builds(lambda base, op, members: {**base, op: members}, leaf_filters | st.just({}),
                  st.sampled_from(LOGICAL), st.lists(inner, max_size=3)),
        st.builds(lambda op, value: {op: value}, st.sampled_from(LOGICAL),
                  st.sampled_from(["not a list", {"category": "work"}, [{"category": "work"}, 42]])),
        st.builds(lambda a, b: {"OR": a, "$or": b}, st.lists(inner, max_size=2), st.lists(inner, max_size=2)),
    ),
    max_leaves=6,
)


def qdrant_selects(where: dict, rows: list[dict]):
    """Which rows Mem0's Qdrant store selects, or "refused"."""
    translator = object.__new__(qdrant_store.Qdrant)
    try:
        built = translator._create_filter(where)
        if built is None:
            return [True] * len(rows)
        return [payload_filters.check_filter(built, row, point_id=i, has_vector={}) for i, row in enumerate(rows)]
    except ValueError:  # Mem0's own errors and Qdrant's validation errors (a ValueError) alike
        return "refused"


def inferscale_selects(where: dict, rows: list[dict]):
    try:
        built = compile_filters(where)
    except ValueError:
        return "refused"
    return [built is None or built.matches(row) for row in rows]


def ne_boolean(where) -> bool:
    """Whether a filter holds ``{"ne": <bool>}``, which Qdrant refuses and the provider accepts."""
    if isinstance(where, dict):
        return any((k == "ne" and isinstance(v, bool)) or ne_boolean(v) for k, v in where.items())
    return isinstance(where, list) and any(map(ne_boolean, where))


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(where=filters, rows=st.lists(payloads, min_size=1, max_size=6))
def test_every_filter_selects_what_qdrant_selects(where, rows):
    assume(not ne_boolean(where))
    assert inferscale_selects(where, rows) == qdrant_selects(where, rows)


def test_ne_takes_a_boolean_as_mem0s_docs_show_it():
    """Qdrant refuses ``{"ne": True}`` (its except-list holds strings or integers); here it selects values
    that are not ``true``, and, like every ``ne``, not memories without the key."""
    where = {"archived": {"ne": True}}
    assert qdrant_selects(where, ROWS) == "refused"
    rows = [{"archived": False}, {"archived": True}, {}, {"archived": None}, {"archived": [True, False]},
            {"archived": 1}]
    assert inferscale_selects(where, rows) == [True, False, False, False, True, True]


ROWS = [
    {"user_id": "alice", "category": "work", "priority": 7, "status": "active", "score": 0.85, "rating": 3,
     "confidence": 0.5, "archived": False, "title": "Weekly meeting notes", "description": "Very IMPORTANT",
     "tags": ["urgent", "python"], "deadline": "due today", "created_at": "2025-06-15T10:30:00.123456-07:00"},
    {"user_id": "alice", "category": "personal", "priority": 3, "status": "completed", "score": 0.4,
     "archived": True, "tags": ["rust"], "created_at": "2025-01-02T00:00:00Z"},
    {"user_id": "alice", "category": "food", "priority": 9, "status": "deleted", "created_at": "2026-02-01"},
    {"user_id": "alice", "category": "archived", "priority": 10, "status": "archived"},
    {"user_id": "bob", "category": "travel", "priority": 5, "status": "active", "tags": "urgent"},
    {"agent_id": "helper", "category": "work"},
]
DOCUMENTED = [  # Mem0's metadata-filtering page, then its Qdrant store's tests (TestQdrantEnhancedFilters, dates)
    {"user_id": "alice", "category": "preferences"},
    {"user_id": "alice", "score": {"gt": 0.8}, "priority": {"gte": 5}, "confidence": {"lt": 0.9}, "rating": {"lte": 3}},
    {"user_id": "alice", "status": {"eq": "active"}, "archived": {"ne": True}},
    {"user_id": "alice", "status": {"ne": "completed"}},
    {"user_id": "alice", "category": {"in": ["food", "travel", "entertainment"]}, "status": {"nin": ["deleted", "archived"]}},
    {"user_id": "alice", "title": {"contains": "meeting"}, "description": {"icontains": "important"},
     "tags": {"contains": "urgent"}},
    {"user_id": "alice", "category": "*"},
    {"user_id": "alice", "AND": [{"category": "work"}, {"priority": {"gte": 7}}, {"status": {"ne": "completed"}}]},
    {"user_id": "alice", "OR": [{"category": "urgent"}, {"priority": {"gte": 9}}, {"deadline": {"contains": "today"}}]},
    {"user_id": "alice", "NOT": [{"category": "archived"}, {"status": "deleted"}]},
    {"user_id": "alice", "AND": [{"OR": [{"category": "work"}, {"category": "personal"}]}, {"priority": {"gte": 5}},
                                 {"NOT": [{"status": "archived"}]}]},
    {"user_id": "alice", "AND": [{"category": "work"}, {"content": {"contains": "meeting"}}]},
    {"user_id": "alice", "count": {"gte": 5, "lte": 10}},
    {"category": {"eq": "*"}}, {"tags": ["python", "rust"]}, {"priority": {"in": [1, 2, 3]}},
    {"archived": True}, {"archived": {"eq": False}}, {"priority": 10}, {"score": {"gt": 0.5, "lt": 0.9}},
    {"AND": [{"category": "*"}, {"user_id": "alice"}]}, {"OR": []}, {"NOT": []}, {"AND": []},
    {"user_id": "alice", "$or": [{"category": "work"}, {"category": "food"}]},
    {"OR": [{"category": "work"}], "user_id": "alice", "$or": [{"category": "work"}]},
    {"NOT": [{"category": "work"}], "user_id": "alice", "$not": [{"category": "work"}]},
    {"created_at": {"gte": "2025-01-01T00:00:00Z", "lte": "2025-12-31T23:59:59Z"}},
    {"created_at": {"gte": "2025-01-01", "lt": "2025-02-01"}}, {"created_at": {"gt": "2025-06-15T10:30:00+05:30"}},
    {"created_at": {"gte": "2025-01-01T00:00:00.123456Z"}}, {"created_at": {"gte": "2025-01-01 10:30:00"}},
    {"created_at": {"gte": "2025-01-01"}, "priority": {"gte": 5}},
]
REFUSED = [{"field": {"unknown_op": "foo"}}, {"priority": {"gte": 5, "ne": 10}}, {"score": {"gt": 0.5, "eq": 1.0}},
           {"AND": "not_a_list"}, {"OR": {"category": "work"}}, {"NOT": "invalid"}, {"AND": ["not_a_dict", {"f": 1}]},
           {"OR": [{"f": "v"}, 42]}, {"field": {}}, {"created_at": {"gte": "2025-13-45"}},
           {"field": {"gte": "2025-01-01", "lte": 100}}, {"category": {"in": "work"}}, {"score": 0.5}]


@pytest.mark.parametrize("where", DOCUMENTED, ids=str)
def test_documented_filters_select_what_qdrant_selects(where):
    selected = inferscale_selects(where, ROWS)
    assert selected != "refused" and (ne_boolean(where) or selected == qdrant_selects(where, ROWS))


@pytest.mark.parametrize("where", REFUSED, ids=str)
def test_filters_qdrant_refuses_are_refused_with_a_value_error(where):
    assert qdrant_selects(where, ROWS) == "refused"
    with pytest.raises(ValueError):
        compile_filters(where)


def test_the_wildcard_and_empty_filters_select_everything():
    for where in ({"category": "*"}, {}, None, {"AND": [{"x": "*"}]}, {"OR": [], "NOT": []}):
        assert compile_filters(where) is None
    assert compile_filters({"category": {"eq": "*"}}).matches({"category": "*"})
    assert not compile_filters({"category": {"eq": "*"}}).matches({"category": "work"})


def test_narrowing_names_the_users_an_exact_match_can_select():
    def users(key, values):
        return {v for kind, v in values if kind == "str"} if key == "user_id" else None

    def names(where):
        return narrowed(compile_filters(where), users)

    assert names({"user_id": "alice"}) == {"alice"}
    assert names({"user_id": {"in": ["alice", "bob"]}, "AND": [{"user_id": ["bob", "carol"]}]}) == {"bob"}
    assert names({"OR": [{"user_id": "a"}, {"user_id": {"eq": "b"}}]}) == {"a", "b"}
    assert names({"OR": [{"user_id": "a"}, {"category": "work"}]}) is None
    assert names({"user_id": {"ne": "a"}}) is None and names({"category": "work"}) is None
    assert names({"user_id": 7}) == set() and names({"NOT": [{"user_id": "a"}]}) is None


def test_paths_read_like_qdrants():
    assert parse_path("a.b[].c[2]") == ("a", "b", None, "c", 2) and parse_path('"a.b".c') == ("a.b", "c")
    for bad in ("a b", "a.", "a..b", "a[x]", "a[", '"a'):
        with pytest.raises(ValueError):
            parse_path(bad)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(st.sampled_from(["alice", "bob", "7", None]), payloads), min_size=1, max_size=30),
       where=filters, k=st.integers(1, 6))
def test_the_store_lists_and_ranks_what_the_filter_selects(rows, where, k):
    """Narrowing by user, what it leaves to read, the over-fetch and the scan: the store's answers are
    the brute-force ones over every memory the filter selects."""
    import torch

    from inferscale.mem0.store import RetrieverVectorStore
    from inferscale.retrieval.exact import ExactRetriever

    stored = [{**{k_: v for k_, v in p.items() if k_ != "user_id"}, **({"user_id": u} if u else {})} for u, p in rows]
    ids = [f"m{i:03d}" for i in range(len(stored))]
    x = torch.nn.functional.normalize(torch.randn(len(stored), 4, generator=torch.Generator().manual_seed(len(stored))))
    q = torch.randn(4, generator=torch.Generator().manual_seed(1))
    store = RetrieverVectorStore(ExactRetriever(), dim=4)
    store.insert(x.tolist(), stored, ids)
    selected = inferscale_selects(where, stored)
    if selected == "refused":
        with pytest.raises(ValueError):
            store.list(where)
        return
    kept = [i for i, s in zip(ids, selected) if s]
    assert [r.id for r in store.list(where, top_k=None)[0]] == kept
    scores = (x @ torch.nn.functional.normalize(q, dim=0)).tolist()
    best = sorted((i for i in range(len(ids)) if selected[i]), key=lambda i: (-scores[i], ids[i]))[:k]
    found = store.search("q", q.tolist(), k, where)
    assert [r.id for r in found] == [ids[i] for i in best]
    assert [r.score for r in found] == pytest.approx([scores[i] for i in best], abs=1e-5)


def test_a_file_holding_another_users_memory_is_that_users_loss():
    import tempfile

    import torch

    from inferscale.mem0.collection_files import CollectionFiles, UserMemories
    from inferscale.mem0.store import RetrieverVectorStore
    from inferscale.retrieval.exact import ExactRetriever

    with tempfile.TemporaryDirectory() as root:
        files = CollectionFiles(root)
        files.save(UserMemories("alice", ["m1"], torch.eye(4)[:1], [{"user_id": "bob"}]))
        files.save(UserMemories("carol", ["m2"], torch.eye(4)[1:2], [{"user_id": "carol"}]))
        store = RetrieverVectorStore(ExactRetriever(), files=files)
        assert [r.id for r in store.list({"user_id": "carol"})[0]] == ["m2"] and store.list({"user_id": "bob"}) == [[]]
        with pytest.raises(Exception, match="holds a memory whose user_id is not 'alice'"):
            store.list({"user_id": "alice"})
