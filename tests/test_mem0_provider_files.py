"""Provider "inferscale" under bad files and bad ids, through a real ``mem0.Memory``: an unreadable
user file costs that user alone (and says which file, never where on the machine), a write to that
user is refused with the file left as it was, user ids are checked before anything is indexed, and
what was stored is found again by a new process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from mem0_setup import SCRIPT_HEAD, inferscale_config, mem0_module, qdrant_config  # noqa: F401  (a fixture)

from inferscale.errors import CorruptDataError

ALICE = ["I adopted a grey cat named Oscar.", "My sister Ana lives in Porto."]
BOB = ["I play the cello in an orchestra."]


def users_dir(data_dir):
    return data_dir / "mem0" / "vectors" / "mem0" / "users"


def write_alice_and_bob(mem0_module, data_dir):
    memory = mem0_module.Memory.from_config(inferscale_config(data_dir))
    for user, texts in (("alice", ALICE), ("bob", BOB)):
        for text in texts:
            memory.add(text, user_id=user, infer=False, metadata={"category": "life"})
    memory.close()


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def emptied(path):
    path.write_bytes(b"")


def garbage(path):
    path.write_bytes(os.urandom(300))


def directory(path):
    path.unlink()
    path.mkdir()
    (path / "inside").write_text("not a file of memories")


def bobs_file(path):
    path.write_bytes((path.parent / "bob.safetensors").read_bytes())


def snapshot(path):
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else path.read_bytes()


@pytest.mark.parametrize("damage", [truncate, emptied, garbage, directory, bobs_file])
def test_an_unreadable_user_file_costs_that_user_alone(mem0_module, tmp_path, damage, caplog):
    write_alice_and_bob(mem0_module, tmp_path)
    alice_file = users_dir(tmp_path) / "alice.safetensors"
    damage(alice_file)
    before = snapshot(alice_file)

    with caplog.at_level(logging.WARNING, logger="inferscale.mem0.store"):
        memory = mem0_module.Memory.from_config(inferscale_config(tmp_path))
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "inferscale.mem0.store"]
    assert "'alice'" in warning and "users/alice.safetensors" in warning and str(tmp_path) not in warning

    assert [r["memory"] for r in memory.search("What do I play?", filters={"user_id": "bob"})["results"]] == BOB
    assert [r["memory"] for r in memory.get_all(filters={"category": "life", "user_id": "bob"})["results"]] \
        == BOB
    for read in (lambda: memory.search("pets", filters={"user_id": "alice"}),
                 lambda: memory.get_all(filters={"user_id": "alice"}),
                 lambda: memory.add("I also have a dog.", user_id="alice", infer=False)):
        with pytest.raises(CorruptDataError, match="user 'alice' are unreadable") as info:
            read()
        assert "users/alice.safetensors" in str(info.value) and str(tmp_path) not in str(info.value)
    assert snapshot(alice_file) == before  # the write to alice was refused before it touched her file
    memory.close()

    import inferscale.mem0

    assert inferscale.mem0.forget_user(tmp_path / "mem0", "alice") == 0 and not alice_file.exists()
    again = mem0_module.Memory.from_config(inferscale_config(tmp_path))
    again.add("I also have a dog.", user_id="alice", infer=False)
    assert [r["memory"] for r in again.get_all(filters={"user_id": "alice"})["results"]] == ["I also have a dog."]
    again.close()


@pytest.mark.parametrize("user_id", ["a\x00b", "x" * 129, "a\nb"], ids=["nul", "too-long", "newline"])
def test_user_ids_are_checked_before_anything_is_indexed(mem0_module, tmp_path, user_id):
    from inferscale.mem0.provider import InferScaleVectorStore

    store = InferScaleVectorStore(data_dir=str(tmp_path), embedding_model_dims=4)
    with pytest.raises(ValueError, match="user_id"):
        store.insert([[1.0, 0, 0, 0], [0, 1.0, 0, 0]], [{"user_id": "fine"}, {"user_id": user_id}], ["m1", "m2"])
    assert store.col_info()["count"] == 0 and store.search("q", [1.0, 0, 0, 0], 5) == [] and store.get("m1") is None
    assert not (tmp_path / "mem0").exists()  # nothing written either
    for bad in ({"user_id": 7}, {"user_id": ""}, {"user_id": "_shared"}, {"user_id": ["a"]}):
        with pytest.raises(ValueError, match="user_id"):
            store.insert([[1.0, 0, 0, 0]], [bad], ["m3"])
    with pytest.raises(ValueError, match="a payload must be JSON"):
        store.insert([[1.0, 0, 0, 0]], [{"user_id": "fine", "when": object()}], ["m4"])
    assert store.col_info()["count"] == 0


def test_mem0_cannot_index_a_user_id_the_store_refuses(mem0_module, tmp_path):
    """Mem0 lets a NUL through (it refuses whitespace only): the store refuses it, indexing nothing."""
    memory = mem0_module.Memory.from_config(inferscale_config(tmp_path))
    with pytest.raises(ValueError, match="user_id must not contain whitespace or control characters"):
        memory.add("I like tea.", user_id="a\x00b", infer=False)
    assert memory.vector_store.col_info()["count"] == 0 and memory.get_all(filters={"user_id": "a\x00b"})["results"] == []
    memory.close()


def test_an_int_user_id_filter_selects_what_qdrant_selects(mem0_module, tmp_path):
    """Mem0 turns an int ``user_id`` into a string before the store sees it; a store called directly
    with an int matches no string id, on Qdrant as here (its equality keeps JSON types apart)."""
    ours = mem0_module.Memory.from_config(inferscale_config(tmp_path / "ours"))
    qdrant = mem0_module.Memory.from_config(qdrant_config(tmp_path / "qdrant"))
    found = []
    for memory in (ours, qdrant):
        memory.add("I like green tea.", user_id="7", infer=False)
        via_mem0 = [r["memory"] for r in memory.search("tea", filters={"user_id": 7})["results"]]
        listed = [r["memory"] for r in memory.get_all(filters={"user_id": 7})["results"]]
        vector = memory.embedding_model.embed("tea", "search")
        direct = memory.vector_store.search("tea", vector, 5, {"user_id": 7})
        direct_in = memory.vector_store.search("tea", vector, 5, {"user_id": {"in": [7]}})
        found.append((via_mem0, listed, list(direct), list(direct_in), len(memory.vector_store.list({"user_id": 7})[0])))
        memory.close()
    assert found[0] == found[1] == (["I like green tea."], ["I like green tea."], [], [], 0)


SEEN = textwrap.dedent("""
    from mem0_setup import inferscale_config
    RETRIEVERS = {"exact": "exact", "hnsw": {"name": "faiss", "options": {"kind": "hnsw", "approx_min": 2}}}

    def seen(memory):
        return {
            "search": [[(r["id"], r["memory"], round(r["score"], 5), r.get("metadata")) for r in
                        memory.search(q, filters={"user_id": "alice"}, top_k=3, threshold=0.0)["results"]]
                       for q in ("Which pet do I have?", "Where does my sister live?")],
            "filtered": [r["memory"] for r in memory.search("family", filters={"user_id": "alice", "n": {"gte": 1}})["results"]],
            "listed": sorted((r["id"], r["memory"]) for r in memory.get_all(filters={"user_id": "alice"})["results"]),
            "bob": [r["memory"] for r in memory.get_all(filters={"user_id": "bob"})["results"]],
            "history": sorted([h["event"] for h in memory.history(r["id"])] for r in
                              memory.get_all(filters={"user_id": "alice"})["results"]),
        }
""")
WRITER = SCRIPT_HEAD + SEEN + textwrap.dedent("""
    data, views = sys.argv[1], {}
    for name, retriever in RETRIEVERS.items():
        memory = mem0.Memory.from_config(inferscale_config(os.path.join(data, name), retriever))
        ids = [memory.add(t, user_id=u, infer=False, metadata={"n": i})["results"][0]["id"]
               for i, (u, t) in enumerate([("alice", "I adopted a grey cat named Oscar."),
                                           ("alice", "My sister Ana lives in Porto."),
                                           ("alice", "I am allergic to peanuts."), ("bob", "I play the cello.")])]
        memory.update(ids[1], text="My sister Ana moved to Lisbon.")
        memory.delete(ids[2])
        views[name] = seen(memory)
        memory.close()
    print(json.dumps(views))
""")
READER = SCRIPT_HEAD + SEEN + textwrap.dedent("""
    data, views = sys.argv[1], {}
    for name, retriever in RETRIEVERS.items():
        memory = mem0.Memory.from_config(inferscale_config(os.path.join(data, name), retriever))
        views[name] = seen(memory)
        memory.close()
    print(json.dumps(views))
""")


def run_script(script: str, *args: str, **env: str) -> str:
    """Run a script in a new interpreter (Mem0's own folder under the test's temp dir)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
           **env}
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_what_one_process_stored_another_process_finds(tmp_path):
    home = str(tmp_path / "home")
    written = json.loads(run_script(WRITER, str(tmp_path), MEM0_DIR=home).splitlines()[-1])
    first = json.loads(run_script(READER, str(tmp_path), MEM0_DIR=home).splitlines()[-1])
    second = json.loads(run_script(READER, str(tmp_path), MEM0_DIR=home).splitlines()[-1])
    assert first == written and second == written  # a new process finds the same, and reading changes nothing
    for seen in written.values():
        pets, sister = seen["search"]
        assert pets[0][1] == "I adopted a grey cat named Oscar." and pets[0][3] == {"n": 0} and len(pets) == 2
        assert sister[0][1] == "My sister Ana moved to Lisbon."
        assert seen["filtered"] == ["My sister Ana moved to Lisbon."]
        assert sorted(m for _, m in seen["listed"]) == ["I adopted a grey cat named Oscar.", "My sister Ana moved to Lisbon."]
        assert seen["bob"] == ["I play the cello."] and seen["history"] == [["ADD"], ["ADD", "UPDATE"]]
    exact, hnsw = ([[r[1:3] for r in rows] for rows in written[name]["search"]] for name in ("exact", "hnsw"))
    assert exact == hnsw


def test_mem0_telemetry_leaves_no_collection_in_the_data_dir(tmp_path):
    """Mem0's telemetry (on by default) opens a "mem0migrations" collection of the configured provider."""
    script = SCRIPT_HEAD + textwrap.dedent("""
        from mem0.memory import telemetry
        from mem0_setup import inferscale_config
        assert telemetry.MEM0_TELEMETRY
        memory = mem0.Memory.from_config(inferscale_config(sys.argv[1]))
        memory.add("I like tea.", user_id="alice", infer=False)
        assert memory._telemetry_vector_store.collection_name == "mem0migrations"
        memory.close()
    """)
    run_script(script, str(tmp_path / "data"), MEM0_TELEMETRY="True", MEM0_DIR=str(tmp_path / "home"))
    assert sorted(p.name for p in (tmp_path / "data" / "mem0" / "vectors").iterdir()) == ["mem0"]
    assert [p.name for p in users_dir(tmp_path / "data").iterdir()] == ["alice.safetensors"]


def test_a_collection_that_is_only_read_leaves_nothing(mem0_module, tmp_path):
    from inferscale.mem0.provider import InferScaleVectorStore

    store = InferScaleVectorStore(data_dir=str(tmp_path / "data"), collection_name="c", embedding_model_dims=4)
    assert store.list({"user_id": "alice"}) == [[]] and store.search("q", [1.0, 0, 0, 0], 3) == []
    store.delete("nothing")
    assert list((tmp_path / "data").iterdir()) == []
    store.insert(torch.eye(4)[:1].tolist(), [{"user_id": "alice"}], ["m1"])
    assert (tmp_path / "data" / "mem0" / "vectors" / "c" / "users" / "alice.safetensors").is_file()
