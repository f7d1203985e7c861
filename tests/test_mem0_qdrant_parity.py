"""Provider "inferscale" against Mem0's default store, Qdrant (local), on the same memories through
``mem0.Memory`` (``infer=False``, local MiniLM): every filter form of Mem0 2.2.1's docs and of its
Qdrant store's tests gives the same results in ``search`` (same memories, same scores) and in
``get_all``; scores are cosine like Qdrant's for vectors of any length; ``col_info`` names the
distance; collection calls this store cannot mean are refused saying what to do."""

from __future__ import annotations

import pytest
import torch
from mem0_setup import inferscale_config, mem0_module, qdrant_config  # noqa: F401  (a fixture)

ALICE = [
    ("I have a weekly team meeting on Mondays.", {"category": "work", "priority": 7, "status": "active", "score": 0.85,
                                                  "tags": ["urgent", "meeting"], "due": "2025-06-15T10:30:00Z",
                                                  "title": "Weekly meeting notes", "rating": 2}),
    ("My favourite food is ramen.", {"category": "food", "priority": 3, "status": "active", "score": 0.4, "rating": 5}),
    ("I plan a trip to Japan in spring.", {"category": "travel", "priority": 9, "status": "archived",
                                           "due": "2026-03-01"}),
    ("I finished the quarterly report.", {"category": "work", "priority": 5, "status": "completed",
                                          "confidence": 0.95, "due": "2025-01-20 09:00:00"}),
    ("I go to the gym three times a week.", {"category": "personal", "priority": 4, "status": "active",
                                             "archived": False}),
    ("My sister Ana lives in Porto.", {"category": "personal", "priority": 2, "status": "deleted", "archived": True}),
    ("I am learning Python and Rust.", {"category": "learning", "priority": 8, "status": "active",
                                        "description": "An IMPORTANT skill", "tags": ["python", "rust"]}),
    ("I have a dentist appointment today.", {"category": "urgent", "priority": 10, "status": "active",
                                             "deadline": "today at 4pm", "confidence": 0.6}),
]
QUERY = "What is on my schedule?"
ALICE_FILTERS = [  # Mem0's metadata-filtering page, each with the user it needs
    {"category": "work"},
    {"score": {"gt": 0.8}, "priority": {"gte": 5}, "confidence": {"lt": 0.9}, "rating": {"lte": 3}},
    {"priority": {"gte": 5}}, {"rating": {"lte": 3}}, {"confidence": {"lt": 0.9}},
    {"status": {"eq": "active"}}, {"status": {"ne": "completed"}},
    {"category": {"in": ["food", "travel", "entertainment"]}, "status": {"nin": ["deleted", "archived"]}},
    {"title": {"contains": "meeting"}}, {"description": {"icontains": "important"}}, {"tags": {"contains": "urgent"}},
    {"category": "*"},
    {"AND": [{"category": "work"}, {"priority": {"gte": 7}}, {"status": {"ne": "completed"}}]},
    {"OR": [{"category": "urgent"}, {"priority": {"gte": 9}}, {"deadline": {"contains": "today"}}]},
    {"NOT": [{"category": "archived"}, {"status": "deleted"}]},
    {"AND": [{"OR": [{"category": "work"}, {"category": "personal"}]}, {"priority": {"gte": 5}},
             {"NOT": [{"status": "archived"}]}]},
    {"AND": [{"category": "work"}, {"content": {"contains": "meeting"}}]},
    # Mem0's Qdrant store tests
    {"category": {"eq": "work"}}, {"status": {"nin": ["deleted", "archived"]}}, {"priority": {"gt": 7}},
    {"priority": {"gte": 5, "lte": 9}}, {"score": {"gt": 0.5, "lt": 0.9}}, {"tags": ["python", "rust"]},
    {"priority": {"in": [2, 3, 10]}}, {"archived": True}, {"archived": {"eq": False}}, {"priority": 10},
    {"category": {"eq": "*"}}, {"AND": [{"category": "*"}, {"priority": {"lt": 4}}]},
    {"$or": [{"category": "food"}, {"category": "travel"}]}, {"$not": [{"category": "work"}]},
    {"OR": [{"category": "food"}], "$or": [{"category": "food"}]},
    {"AND": [{"OR": [{"category": "work"}, {"category": "personal"}]}, {"priority": {"gte": 5}},
             {"NOT": [{"status": "archived"}]}]},
    # date ranges (Mem0's own created_at, and a date of the memories' metadata)
    {"created_at": {"gte": "2020-01-01T00:00:00Z", "lte": "2999-12-31T23:59:59Z"}},
    {"created_at": {"lt": "2020-01-01"}}, {"due": {"gte": "2025-01-01", "lt": "2025-12-31"}},
    {"due": {"gt": "2025-06-15T10:30:00+05:30"}}, {"due": {"gte": "2025-01-20 09:00:00.000001"}},
    {"due": {"gte": "2025-01-01"}, "priority": {"gte": 5}},
]
OTHER_FILTERS = [{"user_id": "bob"}, {"agent_id": "helper"}, {"agent_id": "helper", "category": "style"},
                 {"user_id": "bob", "category": "*"}, {"agent_id": "nobody"}]


@pytest.fixture(scope="module")
def stores(mem0_module, tmp_path_factory):
    """The same memories in a Memory over provider "inferscale" and one over Qdrant local."""
    built = {}
    for name, config in (("inferscale", inferscale_config), ("qdrant", qdrant_config)):
        memory = mem0_module.Memory.from_config(config(tmp_path_factory.mktemp(name)))
        for text, metadata in ALICE:
            memory.add(text, user_id="alice", infer=False, metadata=metadata)
        memory.add("I play the cello in an orchestra.", user_id="bob", infer=False, metadata={"category": "personal"})
        memory.add("The user prefers short answers.", agent_id="helper", infer=False, metadata={"category": "style"})
        built[name] = memory
    yield built
    for memory in built.values():
        memory.close()


def searched(memory, filters: dict) -> list[tuple[str, float]]:
    return [(r["memory"], r["score"]) for r in memory.search(QUERY, filters=filters, top_k=20, threshold=0.0)["results"]]


def listed(memory, filters: dict) -> list[str]:
    return sorted(r["memory"] for r in memory.get_all(filters=filters, top_k=50)["results"])


@pytest.mark.parametrize("filters", [{"user_id": "alice", **f} for f in ALICE_FILTERS] + OTHER_FILTERS, ids=str)
def test_search_and_get_all_give_what_qdrant_gives(stores, filters):
    ours, qdrant = (searched(stores[name], dict(filters)) for name in ("inferscale", "qdrant"))
    assert [m for m, _ in ours] == [m for m, _ in qdrant]
    assert [s for _, s in ours] == pytest.approx([s for _, s in qdrant], abs=1e-4)
    assert listed(stores["inferscale"], dict(filters)) == listed(stores["qdrant"], dict(filters))


def test_the_filters_are_not_vacuous(stores):
    """The forms above select different, non-empty subsets (so agreeing with Qdrant says something)."""
    sizes = {str(f): len(listed(stores["inferscale"], {"user_id": "alice", **f})) for f in ALICE_FILTERS}
    assert len(searched(stores["inferscale"], {"user_id": "alice", "category": "*"})) == len(ALICE)
    assert len(set(sizes.values())) >= 6 and sizes[str({"category": "*"})] == len(ALICE)
    assert 0 < sizes[str({"due": {"gte": "2025-01-01", "lt": "2025-12-31"}})] < len(ALICE)
    assert sizes[str({"created_at": {"lt": "2020-01-01"}})] == 0


def test_a_filter_qdrant_refuses_is_refused_alike(stores):
    for memory in stores.values():
        with pytest.raises(ValueError, match="[Cc]annot mix range operators"):
            memory.search(QUERY, filters={"user_id": "alice", "priority": {"gte": 5, "ne": 10}})
        with pytest.raises(ValueError, match="Unsupported"):
            memory.vector_store.list(filters={"user_id": "alice", "priority": {"like": 5}})


def unit_and_scaled(n: int, dim: int) -> torch.Tensor:
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(3))
    return x * torch.linspace(0.05, 20.0, n)[:, None]  # lengths from 0.05 to 20


def test_scores_are_cosine_like_qdrants_for_vectors_of_any_length(mem0_module, tmp_path):
    from mem0.vector_stores.qdrant import Qdrant

    from inferscale.mem0.provider import InferScaleVectorStore

    x, q = unit_and_scaled(40, 16), torch.randn(16, generator=torch.Generator().manual_seed(4)) * 7.0
    ids = [f"00000000-0000-0000-0000-{i:012d}" for i in range(40)]
    payloads = [{"user_id": "alice", "n": i} for i in range(40)]
    ours = InferScaleVectorStore(data_dir=str(tmp_path / "ours"), embedding_model_dims=16)
    qdrant = Qdrant(collection_name="mem0", embedding_model_dims=16, path=str(tmp_path / "qdrant"))
    for store in (ours, qdrant):
        store.insert(x.tolist(), payloads, ids)
    for filters in ({"user_id": "alice"}, {"user_id": "alice", "n": {"lt": 10}}, None):
        found = [[(str(r.id), r.score) for r in store.search("q", q.tolist(), 10, filters)] for store in (ours, qdrant)]
        assert [i for i, _ in found[0]] == [i for i, _ in found[1]]
        assert [s for _, s in found[0]] == pytest.approx([s for _, s in found[1]], abs=1e-5)
        assert all(-1.0 - 1e-6 <= s <= 1.0 + 1e-6 for _, s in found[0])
    assert ours.col_info() == {"name": "mem0", "count": 40, "dimension": 16, "distance": "cosine"}
    assert qdrant.col_info().config.params.vectors.distance.value.lower() == ours.col_info()["distance"]
    again = InferScaleVectorStore(data_dir=str(tmp_path / "ours"), embedding_model_dims=16)  # the files hold unit vectors
    assert [r.score for r in again.search("q", q.tolist(), 5, {"user_id": "alice"})] == \
        pytest.approx([r.score for r in ours.search("q", q.tolist(), 5, {"user_id": "alice"})], abs=1e-6)
    qdrant.client.close()


def test_dot_scores_are_inner_products_when_asked_for(mem0_module, tmp_path):
    from inferscale.mem0.provider import InferScaleVectorStore

    x = unit_and_scaled(5, 8)
    store = InferScaleVectorStore(data_dir=str(tmp_path), embedding_model_dims=8, distance="dot")
    store.insert(x.tolist(), [{"user_id": "a"}] * 5, [str(i) for i in range(5)])
    best = store.search("q", x[4].tolist(), 1, {"user_id": "a"})[0]
    assert best.score == pytest.approx(float(x[4] @ x[4]), rel=1e-5) and store.col_info()["distance"] == "dot"


def test_collection_calls_the_store_cannot_mean_say_what_to_do(mem0_module, tmp_path):
    from inferscale.mem0.provider import InferScaleVectorStore

    store = InferScaleVectorStore(data_dir=str(tmp_path), collection_name="c", embedding_model_dims=4)
    assert store.create_col("c", 4, "Cosine") is store and store.create_col("c") is store
    with pytest.raises(ValueError, match="build another with collection_name='other'"):
        store.create_col("other", 4)
    with pytest.raises(ValueError, match="holds 4-d vectors, not 8-d.*embedding_model_dims"):
        store.create_col("c", 8)
    with pytest.raises(ValueError, match="scores by cosine, not dot: set the vector store's distance"):
        store.create_col("c", 4, "dot")
    with pytest.raises(Exception, match="distance"):
        InferScaleVectorStore(data_dir=str(tmp_path), distance="euclid")
