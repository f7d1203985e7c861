"""A user id is one user however its accents were typed: ids enter in Unicode's NFC form
everywhere (the Python API, the server's bodies and query strings, chat's ``user``,
``kv_transfer_params``, the command line), the stores hold only that form, and a store written
before holds its users under it after it is opened (disk) or swept (Redis)."""

from __future__ import annotations

import dataclasses
import unicodedata

import pytest

import tiny_models
from inferscale.api import Context, MemoryAPI
from inferscale.cli import build_parser
from inferscale.compose.request import make_params, parse_params
from inferscale.config import BackendSpec, Config, build
from inferscale.facts import check_request_user_id, check_stored_user_id, check_user_id
from inferscale.server.chat.request import parse_chat
from inferscale.server.memory.schemas import AddMemories, SearchMemories
from inferscale.storage.disk import DiskStore
from inferscale.storage.format.index import INDEX_NAME, UserIndex
from redis_server import RedisServer
from test_storage import make_facts

COMPOSED, DECOMPOSED = "jos\u00e9@example.com", "jose\u0301@example.com"


def test_both_forms_are_one_id_in_nfc():
    assert COMPOSED != DECOMPOSED and unicodedata.normalize("NFC", DECOMPOSED) == COMPOSED
    assert check_user_id(DECOMPOSED) == check_user_id(COMPOSED) == COMPOSED
    assert check_request_user_id(DECOMPOSED) == COMPOSED
    with pytest.raises(ValueError, match="at most 128"):
        check_user_id("\u0958" * 100)  # 100 characters, 200 in NFC (a composition exclusion)


def test_a_store_is_given_nfc_ids_only():
    assert check_stored_user_id(COMPOSED) == COMPOSED
    with pytest.raises(ValueError, match="not in Unicode NFC"):
        check_stored_user_id(DECOMPOSED)


def test_every_way_in_normalizes(tmp_path):
    assert AddMemories.model_validate({"user_id": DECOMPOSED, "facts": ["x"]}).user_id == COMPOSED
    assert SearchMemories.model_validate({"user_id": DECOMPOSED, "query": "q"}).user_id == COMPOSED
    chat = parse_chat({"model": "m", "user": DECOMPOSED, "inferscale": {"user_id": COMPOSED},
                       "messages": [{"role": "user", "content": "hi"}]}, 10)
    assert chat.user_id == COMPOSED
    assert parse_params(make_params(DECOMPOSED, ["f-1"])).user_id == COMPOSED
    args = build_parser().parse_args(["facts", DECOMPOSED])
    assert args.user == COMPOSED


def _store_as_before(root, stem: str, facts) -> None:
    """A user written before ids were normalized: directory and index under the decomposed form."""
    store = DiskStore(DiskStore.Options(root=str(root)))
    store.put(COMPOSED, facts)
    old = store.user_dir(COMPOSED)
    index = UserIndex.decode((old / INDEX_NAME).read_bytes(), COMPOSED, "test")
    (old / INDEX_NAME).write_bytes(dataclasses.replace(index, user_id=DECOMPOSED).encode())
    old.rename(old.parent / stem)


def test_the_disk_store_renames_a_user_stored_under_another_form_when_opened(tmp_path):
    facts = make_facts(3)
    _store_as_before(tmp_path / "kv", DECOMPOSED, facts)
    assert [p.name for p in (tmp_path / "kv" / "users").iterdir()] == [DECOMPOSED]
    store = DiskStore(DiskStore.Options(root=str(tmp_path / "kv")))
    assert store.users() == [COMPOSED]
    assert store.list(COMPOSED) == list(facts)
    assert store.get(COMPOSED, list(facts)).num_tokens == sum(kv.num_tokens for kv in facts.values())
    store.delete(COMPOSED, ["f0"])  # the next write writes the composed form
    assert UserIndex.decode((store.user_dir(COMPOSED) / INDEX_NAME).read_bytes(), COMPOSED, "t").user_id == COMPOSED


def test_two_stored_forms_are_left_as_they_are_and_logged(tmp_path, caplog):
    _store_as_before(tmp_path / "kv", DECOMPOSED, make_facts(2))
    (tmp_path / "kv" / "users" / COMPOSED).mkdir()  # the composed form too, before the rename could run
    store = DiskStore(DiskStore.Options(root=str(tmp_path / "kv")))
    assert sorted(p.name for p in (tmp_path / "kv" / "users").iterdir()) == sorted([COMPOSED, DECOMPOSED])
    assert "stored in two Unicode forms" in caplog.text
    assert store.users() == []  # the composed directory holds no index; the other form is not reachable


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis-nfc")).start()
    yield server
    server.stop()


def test_the_redis_store_renames_a_user_stored_under_another_form_when_swept(redis):
    store = build("kv_store", BackendSpec("redis", {"url": redis.url, "prefix": "nfc"}))
    try:
        store.put(COMPOSED, make_facts(2))
        store.client.rename(store.user_key(COMPOSED), store.user_key(DECOMPOSED))  # as written before
        store.client.srem(store.users_key, COMPOSED)
        store.client.sadd(store.users_key, DECOMPOSED)
        assert store.users() == []  # not reachable until swept
        assert store.sweep() == [COMPOSED]
        assert store.users() == [COMPOSED] and store.list(COMPOSED) == ["f0", "f1"]
    finally:
        keys = store.client.keys("nfc:*")
        if keys:
            store.client.delete(*keys)


@pytest.mark.slow  # encodes with the tiny model
def test_the_python_api_takes_either_form_as_one_user(tmp_path):
    model = tiny_models.tiny_model_dir("qwen2", "float32")
    memory = MemoryAPI(Context(Config.from_dict({"model": str(model), "data_dir": str(tmp_path)})))
    try:
        (fact,) = memory.add_facts(DECOMPOSED, ["José keeps bees."])
        assert fact.user_id == COMPOSED and memory.users() == [COMPOSED]
        assert [f.fact_id for f in memory.list_facts(COMPOSED)] == [fact.fact_id]
        assert [f.fact.fact_id for f in memory.search(DECOMPOSED, "bees", k=1)] == [fact.fact_id]
        assert memory.delete_user(DECOMPOSED).facts == 1 and memory.users() == []
    finally:
        memory.close()
