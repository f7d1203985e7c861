"""The Redis store of record, on a real redis-server: the disk store's behaviour (facts whole,
epochs, compaction), shared by two stores as replicas share it, atomic writes, and a server
that is down."""

from __future__ import annotations

import pytest
import torch

from inferscale.config import BackendSpec, Config, build
from inferscale.errors import ConfigError, CorruptDataError, MissingFactError, StoreUnavailableError, UnknownUserError
from inferscale.facts import Fact
from inferscale.storage.redis.store import RedisStore
from inferscale.storage.tiers.record import check_record_store
from inferscale.storage.tiers.fill import ensure_user
from inferscale.storage.tiers import store_of_record
from redis_server import RedisServer
from test_storage import assert_batch, make_facts

pytest.importorskip("redis", reason="pip install 'inferscale-kv[cluster]'")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    redis = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield redis
    redis.stop()


@pytest.fixture
def store(server, request) -> RedisStore:
    prefix = "t" + request.node.name.replace("[", "_").replace("]", "").replace("-", "_")[:40]
    made = build("kv_store", BackendSpec("redis", {"url": server.url, "prefix": prefix}))
    yield made
    keys = made.client.keys(f"{prefix}:*")
    if keys:
        made.client.delete(*keys)


def twin(store: RedisStore) -> RedisStore:
    """A second store on the same server and prefix: another replica."""
    return RedisStore(store.options)


def test_facts_whole_with_records_and_embeddings(store):
    facts = make_facts(4)
    records = {f: Fact(f, "alice", f"text {f}", "D1:1", kv.token_ids) for f, kv in facts.items()}
    vectors = {f: torch.full((8,), float(i)) for i, f in enumerate(facts)}
    store.put("alice", facts, records, vectors)
    assert store.list("alice") == list(facts) and store.users() == ["alice"]
    assert_batch(store.get("alice", ["f2", "f0"]), facts, ["f2", "f0"])
    assert store.facts("alice")["f1"].text == "text f1"
    ids, matrix = store.embeddings("alice")
    assert ids == list(facts) and torch.equal(matrix[3], vectors["f3"])
    epoch, read = store.read_user("alice")
    assert epoch == store.epoch("alice") and list(read) == list(facts)
    assert store.nbytes("alice") == sum(kv.nbytes for kv in facts.values())


def test_every_write_renews_the_epoch_and_another_replica_sees_it(store):
    other = twin(store)
    facts = make_facts(3)
    store.put("bob", {"f0": facts["f0"]})
    first = other.epoch("bob")
    assert first == store.epoch("bob") and other.list("bob") == ["f0"]
    other.put("bob", {"f1": facts["f1"], "f2": facts["f2"]})
    assert store.epoch("bob") not in (None, first) and store.list("bob") == ["f0", "f1", "f2"]
    store.delete("bob", ["f1"])
    assert other.list("bob") == ["f0", "f2"]
    with pytest.raises(MissingFactError, match="user 'bob' has no fact.* f1"):
        other.get("bob", ["f1"])
    other.delete("bob")
    assert store.epoch("bob") is None and store.users() == []
    with pytest.raises(UnknownUserError):
        store.get("bob", ["f0"])


def test_a_memory_tier_filled_from_redis_follows_the_shared_epoch(store):
    """Replica A's cache holds a user; replica B deletes a fact: A's next load drops it."""
    replica_b = twin(store)
    tier = build("kv_store", BackendSpec("hbm", {"device": "cpu"}))
    facts = make_facts(3)
    store.put("carol", facts)
    assert ensure_user(tier, store, "carol") and not ensure_user(tier, store, "carol")
    replica_b.delete("carol", ["f0"])
    assert ensure_user(tier, store, "carol")
    assert tier.list("carol") == ["f1", "f2"] and tier.epoch("carol") == replica_b.epoch("carol")
    replica_b.delete("carol")
    ensure_user(tier, store, "carol")
    assert tier.list("carol") == []


def test_segments_are_compacted_and_replaced_facts_leave(store):
    facts = make_facts(12)
    for fact_id, kv in facts.items():
        store.put("dave", {fact_id: kv})
    fields = [k.decode() for k in store.client.hkeys(store.user_key("dave")) if k.startswith(b"seg-")]
    assert len(fields) <= 5  # O(log n) segments
    store.delete("dave", ["f3"])
    fields = [k.decode() for k in store.client.hkeys(store.user_key("dave")) if k.startswith(b"seg-")]
    blobs = b"".join(store.client.hmget(store.user_key("dave"), fields))
    assert b"f3/keys" not in blobs
    assert_batch(store.get("dave", ["f11", "f0"]), facts, ["f11", "f0"])


def test_a_write_is_one_transaction(store, monkeypatch):
    """A write that fails before EXEC (the process dies, the server refuses) leaves the old version."""
    facts = make_facts(2)
    store.put("erin", {"f0": facts["f0"]})
    before = store.epoch("erin")
    import redis

    def die(self, *args, **kwargs):
        raise redis.exceptions.ConnectionError("connection lost at EXEC")

    monkeypatch.setattr(redis.client.Pipeline, "execute", die)
    with pytest.raises(StoreUnavailableError, match="not committed"):
        store.put("erin", {"f1": facts["f1"]})
    monkeypatch.undo()
    assert store.epoch("erin") == before and twin(store).list("erin") == ["f0"]


def test_concurrent_writers_both_land(store):
    from concurrent.futures import ThreadPoolExecutor

    facts = make_facts(8)
    replicas = [store, twin(store)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: replicas[i % 2].put("frank", {f"f{i}": facts[f"f{i}"]}), range(8)))
    assert sorted(store.list("frank")) == sorted(facts)
    assert_batch(store.get("frank", list(facts)), facts, list(facts))


def test_a_damaged_segment_is_never_returned(store):
    store.put("gina", make_facts(1))
    key = store.user_key("gina")
    (field,) = [k for k in store.client.hkeys(key) if k.startswith(b"seg-")]
    data = bytearray(store.client.hget(key, field))
    data[-1] ^= 0xFF
    store.client.hset(key, field, bytes(data))
    with pytest.raises(CorruptDataError):
        store.get("gina", ["f0"])


def test_the_config_selects_it_as_the_store_of_record(server, tmp_path):
    config = Config.from_dict({"data_dir": str(tmp_path), "store": {"name": "redis", "options": {"url": server.url}}})
    assert isinstance(store_of_record(config), RedisStore)
    assert Config.from_dict(config.to_dict()).store == config.store
    with pytest.raises(ConfigError, match="durable"):
        check_record_store(build("kv_store", BackendSpec("hbm", {"device": "cpu"})))
    with pytest.raises(ConfigError, match="url"):
        build("kv_store", BackendSpec("redis", {"url": "http://x"}))


def test_a_server_that_is_down_is_unavailable_not_empty(tmp_path):
    gone = RedisServer(tmp_path / "gone")
    store = RedisStore(RedisStore.Options(url=gone.url, timeout_s=0.5))
    for call in (lambda: store.epoch("h"), lambda: store.users(), lambda: store.list("h"),
                 lambda: store.put("h", make_facts(1)), lambda: store.delete("h")):
        with pytest.raises(StoreUnavailableError, match="did not answer"):
            call()


def test_the_store_comes_back_with_the_server(tmp_path):
    redis = RedisServer(tmp_path / "r").start()
    try:
        store = RedisStore(RedisStore.Options(url=redis.url, timeout_s=1.0))
        store.put("ivy", make_facts(2))
        redis.kill()
        with pytest.raises(StoreUnavailableError):
            store.put("ivy", {"f9": make_facts(10)["f9"]})
        redis.start()  # the append-only file brings back what was committed, nothing of the failed write
        assert store.list("ivy") == ["f0", "f1"]
    finally:
        redis.stop()


def test_facts_kept_in_fp8_and_converted_by_a_write(store):
    """The same segments as the disk store's (format 4 in fp8); a write in the other form converts the user."""
    from inferscale.kv_fp8 import FP8_E4M3, Fp8KV, all_at_rest, fp8_round_trip

    facts = make_facts(3, torch.bfloat16)
    store.put("alice", dict(list(facts.items())[:2]))
    store.put("alice", all_at_rest({"f2": facts["f2"]}, FP8_E4M3))
    _, kept = store.read_user("alice")
    assert list(kept) == list(facts) and all(isinstance(kv, Fp8KV) for kv in kept.values())
    assert_batch(store.get("alice", list(facts)), {f: fp8_round_trip(kv) for f, kv in facts.items()}, list(facts))
