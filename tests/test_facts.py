"""Fact records, stable ids, and a fact stored whole on disk."""

import pytest
import torch

from inferscale import CorruptDataError, Fact, make_fact_id
from inferscale.facts import render_fact, user_file_stem, user_from_file_stem
from inferscale.kv import FactKV
from inferscale.storage.disk import DiskStore


def test_fact_ids_are_stable_and_distinct():
    a = make_fact_id("ann", "Ann has a cat.", "D1:2")
    assert a == make_fact_id("ann", "Ann has a cat.", "D1:2")
    assert len({a, make_fact_id("bob", "Ann has a cat.", "D1:2"), make_fact_id("ann", "Ann has a cat.", "D1:3"),
                make_fact_id("ann", "Ann has a dog.", "D1:2")}) == 4


def test_keyed_fact_ids_cannot_be_told_from_the_text_without_the_key():
    from inferscale.facts import fact_id_key

    key = fact_id_key(b"s" * 32)
    keyed = make_fact_id("ann", "Ann has a cat.", "D1:2", key)
    assert keyed == make_fact_id("ann", "Ann has a cat.", "D1:2", key)  # stable under one secret
    assert keyed != make_fact_id("ann", "Ann has a cat.", "D1:2")  # not the plain hash anyone can compute
    assert keyed != make_fact_id("ann", "Ann has a cat.", "D1:2", fact_id_key(b"t" * 32))
    assert keyed.startswith("f-") and len(keyed) == 18


@pytest.mark.parametrize("bad", ["", "a/b", "../x", "x" * 200, "sp ace", None, 3, ".", ".."])
def test_fact_ids_are_short_ascii_names(bad):
    with pytest.raises(ValueError):
        Fact(bad, "ann", "text")


@pytest.mark.parametrize("good", ["alice@example.com", "a/b", "../x", "100%", "Zoë", "x" * 128, "user:42", "..."])
def test_user_ids_are_what_mem0_accepts(good):
    assert Fact("f-1", good, "text").user_id == good
    stem = user_file_stem(good)
    assert "/" not in stem and user_from_file_stem(stem) == good


@pytest.mark.parametrize("bad", ["", "alice\n", "al ice", " alice", "alice\t", "a\x00b", "a\u200bb", "a\u202eb",
                                 "x" * 129, "\u00e9" * 101, None, 3, ".", ".."])
def test_user_ids_reject_whitespace_and_control_characters(bad):
    with pytest.raises(ValueError, match="user_id"):
        Fact("f-1", bad, "text")


def test_user_file_names_escape_only_what_a_file_name_cannot_hold():
    assert user_file_stem("alice@example.com") == "alice@example.com"
    assert user_file_stem("a/b%2F") == "a%2Fb%252F"
    assert user_from_file_stem("a%2Fb%252F") == "a/b%2F"


def test_users_with_odd_ids_stay_inside_the_store(tmp_path):
    disk = DiskStore(DiskStore.Options(root=str(tmp_path / "kv")))
    for user in ("alice@example.com", "../escape", "a/b"):
        disk.put(user, {"f-1": _kv((5, 6))})
        assert disk.user_dir(user).parent == tmp_path / "kv" / "users"
    assert disk.users() == sorted(["alice@example.com", "../escape", "a/b"])
    assert sorted(p.name for p in (tmp_path / "kv" / "users").iterdir()) == [
        "..%2Fescape", "a%2Fb", "alice@example.com"]
    assert disk.list("a/b") == ["f-1"] and not (tmp_path / "escape").exists()
    assert not (tmp_path / "kv" / "escape").exists()


def test_render_fact_is_one_bullet_line():
    assert render_fact("  Ann   has\na cat. ") == "- Ann has a cat.\n"


def _segments(root, user):
    return sorted((root / "users" / user).glob("seg-*.safetensors"))


def _kv(ids, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn((2, 2, len(ids), 1, 4), generator=gen)
    return FactKV(ids, kv[0], kv[1])


def test_a_fact_is_stored_whole_in_one_commit(tmp_path):
    """Text, source turn, token ids, embedding and K/V: one put, one index write, one reader."""
    disk = DiskStore(DiskStore.Options(root=str(tmp_path)))
    facts = [Fact("f-1", "ann", "Ann has a cat.", "D1:2", (5, 6)), Fact("f-2", "ann", "Ann runs.", None, (7,))]
    disk.put("ann", {f.fact_id: _kv(f.token_ids, i) for i, f in enumerate(facts)}, {f.fact_id: f for f in facts},
             {"f-1": torch.tensor([1.0, 0, 0]), "f-2": torch.tensor([0, 1.0, 0])})
    assert disk.facts("ann") == {f.fact_id: f for f in facts}
    ids, vectors = disk.embeddings("ann")
    assert ids == ["f-1", "f-2"] and torch.equal(vectors, torch.eye(2, 3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "users"]
    first = _segments(tmp_path, "ann")
    assert len(first) == 1 and sorted(p.name for p in (tmp_path / "users" / "ann").iterdir()) == [
        "index.json", first[0].name]
    # replacing a fact replaces all of it
    new = Fact("f-2", "ann", "Ann runs fast.", "D2:1", (8, 9))
    disk.put("ann", {"f-2": _kv(new.token_ids, 5)}, {"f-2": new}, {"f-2": torch.ones(3)})
    assert disk.facts("ann")["f-2"] == new and disk.token_ids("ann", ["f-2"]) == [(8, 9)]
    assert torch.equal(disk.embeddings("ann")[1][1], torch.ones(3))
    assert b"Ann runs." not in b"".join(p.read_bytes() for p in (tmp_path / "users" / "ann").iterdir())
    # deleting a fact deletes all of it
    disk.delete("ann", ["f-1"])
    assert list(disk.facts("ann")) == ["f-2"] and disk.embeddings("ann")[0] == ["f-2"]
    assert all(b"f-1/" not in p.read_bytes() for p in _segments(tmp_path, "ann"))
    disk.delete("ann")
    assert disk.facts("ann") == {} and disk.embeddings("ann")[0] == [] and disk.users() == []
    assert list((tmp_path / "users").iterdir()) == []


def test_records_must_belong_to_the_facts_put(tmp_path):
    disk = DiskStore(DiskStore.Options(root=str(tmp_path)))
    with pytest.raises(ValueError, match="belong"):
        disk.put("ann", {"f-1": _kv((1,))}, {"f-9": Fact("f-9", "ann", "x")})
    assert disk.users() == []


def test_a_damaged_record_is_detected(tmp_path):
    disk = DiskStore(DiskStore.Options(root=str(tmp_path)))
    disk.put("ann", {"f-1": _kv((1, 2))}, {"f-1": Fact("f-1", "ann", "Ann has a cat.")}, {"f-1": torch.ones(3)})
    path = tmp_path / "users" / "ann" / "index.json"
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"Ann has a cat.", b"Ann has a dog."))
    with pytest.raises(CorruptDataError, match="checksum"):
        disk.facts("ann")


def test_embeddings_are_read_without_the_kv(tmp_path):
    """The index rebuild reads only the embedding tensors: a damaged K/V payload is
    left to the reads that return K/V, which refuse it."""
    disk = DiskStore(DiskStore.Options(root=str(tmp_path)))
    kv = _kv((1, 2))
    disk.put("ann", {"f-1": kv}, {"f-1": Fact("f-1", "ann", "Ann has a cat.")}, {"f-1": torch.ones(3)})
    (path,) = _segments(tmp_path, "ann")
    raw = path.read_bytes()
    key_bytes = kv.keys.contiguous().numpy().tobytes()
    assert raw.count(key_bytes) == 1
    path.write_bytes(raw.replace(key_bytes, bytes(len(key_bytes))))
    fresh = DiskStore(DiskStore.Options(root=str(tmp_path)))
    ids, vectors = fresh.embeddings("ann")
    assert ids == ["f-1"] and torch.equal(vectors, torch.ones(1, 3))
    with pytest.raises(CorruptDataError, match="checksum"):
        fresh.get("ann", ["f-1"])
    (tmp_path / "users" / "ann").rename(tmp_path / "users" / "bob")
    with pytest.raises(CorruptDataError, match="'ann'"):
        fresh.embeddings("bob")
    ids, vectors = fresh.embeddings("nobody")
    assert ids == [] and vectors.numel() == 0


def test_a_fact_put_again_without_text_or_embedding_loses_both(tmp_path):
    """A put replaces a fact whole: what it does not give, the fact no longer has."""
    disk = DiskStore(DiskStore.Options(root=str(tmp_path)))
    disk.put("ann", {"f-1": _kv((1, 2)), "f-2": _kv((3,))}, {"f-1": Fact("f-1", "ann", "Ann has a cat.")},
             {"f-1": torch.ones(3), "f-2": torch.zeros(3)})
    disk.put("ann", {"f-1": _kv((1, 2), seed=1)})
    assert disk.facts("ann")["f-1"].text == "" and disk.embeddings("ann")[0] == ["f-2"]
