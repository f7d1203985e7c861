"""Mem0 with provider "inferscale": a real ``mem0.Memory`` (infer=False, local MiniLM) over the
persistent store, restarted over the same data dir; the collection files on their own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from inferscale.errors import ConfigError, CorruptDataError
from inferscale.mem0.collection_files import CollectionFiles, UserMemories, forget_user_files
from mem0_setup import mem0_module  # noqa: F401  (a fixture)

ALICE = ["I adopted a grey cat named Oscar.", "My sister Ana lives in Porto.",
         "I am allergic to peanuts.", "I take Portuguese lessons on Tuesdays."]
BOB = ["I adopted a dog named Rex.", "I play the cello in an orchestra."]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def mem0_config(data_dir, retriever="exact", **store) -> dict:
    from inferscale.mem0.extract import default_embedder_path

    return {
        "vector_store": {"provider": "inferscale", "config": {
            "data_dir": str(data_dir), "embedding_model_dims": 384, "retriever": retriever, **store}},
        "embedder": {"provider": "huggingface", "config": {
            "model": default_embedder_path(), "embedding_dims": 384, "model_kwargs": {"local_files_only": True}}},
        # never called: every add is infer=False
        "llm": {"provider": "openai", "config": {"api_key": "EMPTY", "openai_base_url": "http://127.0.0.1:9/v1",
                                                 "model": "none"}},
        "history_db_path": str(data_dir / "history.db"),
    }


def found(memory, query: str, user_id: str) -> list[tuple[str, str, float]]:
    results = memory.search(query, filters={"user_id": user_id}, top_k=3)["results"]
    return [(r["id"], r["memory"], r["score"]) for r in results]


def listed(memory, user_id: str) -> dict[str, str]:
    return {r["id"]: r["memory"] for r in memory.get_all(filters={"user_id": user_id}, top_k=100)["results"]}


@pytest.mark.parametrize("retriever", ["exact", {"name": "faiss", "options": {"kind": "hnsw", "approx_min": 2}}],
                         ids=["exact", "faiss-hnsw"])
def test_mem0_over_the_inferscale_provider_survives_a_restart(mem0_module, tmp_path, retriever):
    from inferscale.mem0.provider import InferScaleVectorStore

    import inferscale.mem0

    inferscale.mem0.register()  # registered by the fixture already: registering again is harmless
    memory = mem0_module.Memory.from_config(mem0_config(tmp_path, retriever))
    assert isinstance(memory.vector_store, InferScaleVectorStore)
    ids = {}
    for user, texts in (("alice", ALICE), ("bob", BOB)):
        for i, text in enumerate(texts):
            (row,) = memory.add(text, user_id=user, infer=False, metadata={"fact_id": f"{user}-{i}"})["results"]
            ids[text] = row["id"]
    assert memory.vector_store.retriever.count("alice") == 4 and memory.vector_store.retriever.count("bob") == 2

    pets = found(memory, "Which pet do I have?", "alice")
    assert pets[0][1] == ALICE[0] and {m for _, m, _ in pets} <= set(ALICE)
    assert found(memory, "Which pet do I have?", "bob")[0][1] == BOB[0]
    assert memory.get(ids[ALICE[1]])["metadata"] == {"fact_id": "alice-1"}

    memory.update(ids[ALICE[1]], text="My sister Ana moved to Lisbon.")
    assert found(memory, "Where does my sister live?", "alice")[0][1] == "My sister Ana moved to Lisbon."
    memory.delete(ids[ALICE[2]])
    assert memory.get(ids[ALICE[2]]) is None and len(listed(memory, "alice")) == 3
    memory.delete_all(user_id="bob")
    assert listed(memory, "bob") == {} and memory.vector_store.retriever.count("bob") == 0
    events = [h["event"] for h in memory.history(ids[ALICE[1]])]
    assert events == ["ADD", "UPDATE"]

    queries = ["Which pet do I have?", "Where does my sister live?", "What do I study?"]
    before = [found(memory, q, "alice") for q in queries], listed(memory, "alice")
    memory.close()

    restarted = mem0_module.Memory.from_config(mem0_config(tmp_path, retriever))
    after = [found(restarted, q, "alice") for q in queries], listed(restarted, "alice")
    assert [[(i, m) for i, m, _ in rows] for rows in after[0]] == [[(i, m) for i, m, _ in rows] for rows in before[0]]
    assert [s for rows in after[0] for _, _, s in rows] == pytest.approx([s for rows in before[0] for _, _, s in rows])
    assert after[1] == before[1] and listed(restarted, "bob") == {}
    assert restarted.vector_store.retriever.count("alice") == 3
    assert [h["event"] for h in restarted.history(ids[ALICE[2]])] == ["ADD", "DELETE"]
    restarted.reset()
    assert listed(restarted, "alice") == {}
    assert list(CollectionFiles(tmp_path / "mem0" / "vectors" / "mem0").load()) == []
    restarted.close()


def test_provider_config_errors(mem0_module, tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        mem0_module.Memory.from_config(mem0_config(tmp_path, path="/tmp/x"))
    with pytest.raises(ValidationError, match="collection_name must be"):
        mem0_module.Memory.from_config(mem0_config(tmp_path, collection_name="../elsewhere"))
    with pytest.raises(ConfigError, match="retriever 'exacto' is not registered"):
        mem0_module.Memory.from_config(mem0_config(tmp_path, "exacto"))
    config = mem0_config(tmp_path)
    config["vector_store"]["config"]["embedding_model_dims"] = 1536
    memory = mem0_module.Memory.from_config(config)
    with pytest.raises(ValueError, match="holds 1536-d vectors, got 384-d"):
        memory.add("I like tea.", user_id="alice", infer=False)
    memory.close()


def test_collection_files_round_trip(tmp_path):
    files = CollectionFiles(tmp_path / "col")
    vectors = torch.randn(2, 8)
    files.save(UserMemories("a/b%c", ["m1", "m2"], vectors, [{"data": "één"}, {"data": "two", "n": [1, 2]}]))
    files.save(UserMemories("bob", ["m3"], vectors[:1], [{}]))
    (stored, bob) = sorted(files.load(), key=lambda u: u.user_id)
    assert stored.user_id == "a/b%c" and stored.ids == ["m1", "m2"] and torch.equal(stored.vectors, vectors)
    assert stored.payloads == [{"data": "één"}, {"data": "two", "n": [1, 2]}] and bob.ids == ["m3"]
    files.save(UserMemories("bob", [], torch.empty(0, 8), []))
    assert [u.user_id for u in files.load()] == ["a/b%c"]
    with pytest.raises(ValueError, match="2 ids, 1 payloads"):
        files.save(UserMemories("bob", ["x", "y"], vectors, [{}]))
    files.path("a/b%c").write_bytes(b"not a safetensors file")
    (unreadable,) = files.load()
    assert unreadable.user_id == "a/b%c"
    assert unreadable.reason.startswith("users/a%2Fb%25c.safetensors: not a readable inferscale-mem0/1 file")


def test_forgetting_a_user_removes_their_file_in_every_collection(tmp_path):
    root = tmp_path / "mem0" / "vectors"
    vectors = torch.randn(2, 8)
    first, second = CollectionFiles(root / "mem0"), CollectionFiles(root / "other")
    first.save(UserMemories("ann", ["m1", "m2"], vectors, [{}, {}]))
    first.save(UserMemories("bob", ["m3"], vectors[:1], [{}]))
    second.save(UserMemories("ann", ["m4"], vectors[:1], [{}]))
    assert forget_user_files(root, "ann") == 3
    assert [u.user_id for u in first.load()] == ["bob"] and list(second.load()) == []
    assert forget_user_files(root, "ann") == 0 and forget_user_files(tmp_path / "none", "ann") == 0
    first.path("bob").write_bytes(b"not a safetensors file")  # unreadable: removed all the same
    assert forget_user_files(root, "bob") == 0 and not first.path("bob").exists()


def test_importing_the_entry_point_does_not_import_mem0(tmp_path):
    code = ("import sys, inferscale.mem0, inferscale.mem0.store, inferscale.mem0.provider_config\n"
            "assert 'mem0' not in sys.modules, 'imported mem0 before register()'\n"
            "inferscale.mem0.register()\n"
            "from mem0.utils.factory import VectorStoreFactory\n"
            "assert VectorStoreFactory.provider_to_class['inferscale'] == inferscale.mem0.STORE_CLASS\n")
    env = {**os.environ, "MEM0_TELEMETRY": "False", "MEM0_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_a_reopened_collection_keeps_its_width_and_users(mem0_module, tmp_path):
    from inferscale.mem0.provider import InferScaleVectorStore

    store = InferScaleVectorStore(data_dir=str(tmp_path), collection_name="c")
    x = torch.nn.functional.normalize(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)), dim=1)
    store.insert(x.tolist(), [{"user_id": "alice"}, {"user_id": "bob"}, {}], ["m1", "m2", "m3"])
    assert store.dim == 4  # fixed by the first vectors
    again = InferScaleVectorStore(data_dir=str(tmp_path), collection_name="c", retriever="faiss")
    assert again.dim == 4 and {again.retriever.count(u) for u in ("alice", "bob", "_shared")} == {1}
    assert [r.id for r in again.search("q", x[1].tolist(), 3, {"user_id": "bob"})] == ["m2"]
    assert again.list_cols() == ["c"] and again.col_info()["count"] == 3
    with pytest.raises(ValueError, match="holds 8-d vectors, got 4-d"):
        InferScaleVectorStore(data_dir=str(tmp_path), collection_name="c", embedding_model_dims=8)
    with pytest.raises(ValueError, match="this store holds collection 'c'"):
        again.create_col("other", 4, "cosine")


def test_a_memory_left_in_two_users_files_is_loaded_once(mem0_module, tmp_path):
    """A crash between the two writes of a move leaves two copies; the later ``updated_at`` is the one kept."""
    from inferscale.mem0.provider import InferScaleVectorStore

    files = CollectionFiles(tmp_path / "mem0" / "vectors" / "mem0")
    x = torch.eye(4)
    files.save(UserMemories("alice", ["m1", "m2"], x[:2], [{"user_id": "alice", "updated_at": "2026-01-01"},
                                                   {"user_id": "alice"}]))
    files.save(UserMemories("bob", ["m1"], x[2:3], [{"user_id": "bob", "updated_at": "2026-02-01"}]))
    store = InferScaleVectorStore(data_dir=str(tmp_path))
    assert store.retriever.count("alice") == 1 and store.retriever.count("bob") == 1
    assert store.get("m1").payload["user_id"] == "bob"
    assert [r.id for r in store.search("q", x[0].tolist(), 5, {"user_id": "alice"})] == ["m2"]
