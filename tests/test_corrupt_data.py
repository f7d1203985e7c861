"""Corrupt data of every shape is a :class:`CorruptDataError` for its user alone: never another
exception, never a store (or a server's start-up sweep and index) that stops for everyone."""

from __future__ import annotations

import pytest

from inferscale.config import Config
from inferscale.errors import ConfigError, CorruptDataError
from inferscale.secret import load_secret
from inferscale.storage.disk import store as disk_module
from inferscale.storage.disk import DiskStore
from inferscale.storage.format.index import INDEX_NAME
from inferscale.storage.format.index_cache import PARSED_BYTES_PER_BYTE
from test_storage import make_facts


@pytest.fixture
def store(tmp_path) -> DiskStore:
    store = DiskStore(DiskStore.Options(root=str(tmp_path / "kv")))
    for user in ("ann", "bob"):
        store.put(user, make_facts(3, layers=2, size=8))
    return store


def nest(store: DiskStore, user: str, depth: int = 100_000) -> None:
    (store.user_dir(user) / INDEX_NAME).write_bytes(b"[" * depth + b"]" * depth)


def test_a_deeply_nested_index_is_corrupt_data_for_its_user_alone(store):
    nest(store, "ann")
    for read in (store.list, store.facts, store.epoch, store.embeddings, lambda u: store.token_ids(u, ["f0"])):
        with pytest.raises(CorruptDataError, match="nested too deeply"):
            read("ann")
    assert store.list("bob") == ["f0", "f1", "f2"]


def test_the_start_up_sweep_and_the_index_pass_over_a_corrupt_user(store, tmp_path):
    from inferscale.api import Context

    nest(store, "ann")
    assert store.sweep() == []
    context = Context(Config.from_dict({"data_dir": str(tmp_path)}))
    assert context.retriever is not None  # rebuilt from bob's memory; ann's is left out (and logged)
    store.delete("ann")  # forgetting a corrupt user still removes it
    assert store.users() == ["bob"]


def test_a_missing_segment_is_corrupt_data_when_a_fact_is_deleted(store):
    for segment in store.user_dir("ann").glob("seg-*"):
        segment.unlink()
    with pytest.raises(CorruptDataError, match="segment the index lists is missing"):
        store.delete("ann", ["f0"])


def test_a_secret_path_that_is_a_directory_is_a_clear_error(tmp_path):
    (tmp_path / "secret").mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        load_secret(tmp_path / "secret")


def test_the_index_cache_is_bounded_in_bytes(store, monkeypatch):
    sizes = {u: (store.user_dir(u) / INDEX_NAME).stat().st_size for u in ("ann", "bob")}
    assert store._indexes.max_bytes == disk_module.CACHE_BYTES
    monkeypatch.setattr(store._indexes, "max_bytes", max(sizes.values()) * PARSED_BYTES_PER_BYTE + 1)
    store.list("ann")
    store.list("bob")
    assert len(store._indexes) == 1 and store._indexes.nbytes <= store._indexes.max_bytes
