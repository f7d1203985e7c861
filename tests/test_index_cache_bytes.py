"""The stores' cache of parsed indexes is bounded by the memory the parsed indexes take (a
20,000-fact user's index is 28 MB of Python objects), configurable per store, least recently
used dropped: on the disk store and on the Redis store alike."""

from __future__ import annotations

import gc
import random
import secrets
import tracemalloc

import pytest
import torch

from inferscale.config import BackendSpec, Config, build
from inferscale.storage.disk import DiskStore
from inferscale.storage.format.index import FactEntry, SegmentInfo, UserIndex, new_epoch
from inferscale.storage.format.index_cache import PARSED_BYTES_PER_BYTE, IndexCache
from inferscale.storage.layout import KVLayout
from inferscale.storage.tiers import store_of_record
from redis_server import RedisServer
from test_storage import make_facts


def _big_index(n: int) -> bytes:
    rng = random.Random(0)
    segments = {f"seg-{secrets.token_hex(16)}.safetensors": SegmentInfo("0" * 64, 1000) for _ in range(8)}
    names = list(segments)
    facts = {f"f-{i:016x}": FactEntry(names[i % 8], tuple(rng.randrange(150_000) for _ in range(rng.randint(12, 30))),
                                      {"text": f"User has a pet called something nice, number {i}.", "source_turn": None})
             for i in range(n)}
    return UserIndex("u", new_epoch(), KVLayout(24, 2, 64, torch.float32), facts, segments).encode()


def test_a_parsed_index_takes_no_more_than_the_cache_counts_for_it():
    data = _big_index(5_000)
    gc.collect()
    tracemalloc.start()
    try:
        parsed = UserIndex.decode(data, "u", "test")
        taken, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(parsed.facts) == 5_000
    assert 3 * len(data) < taken <= PARSED_BYTES_PER_BYTE * len(data), (taken, len(data))


def _disk(tmp_path, mib: int) -> DiskStore:
    store = DiskStore(DiskStore.Options(root=str(tmp_path / "kv"), index_cache_mib=mib))
    for user in ("ann", "bob", "cyd"):
        store.put(user, make_facts(3))
    return store


def test_the_disk_stores_cache_holds_what_its_bytes_allow_least_recently_used_out(tmp_path):
    store = _disk(tmp_path, 1)
    size = (store.user_dir("ann") / "index.json").stat().st_size * PARSED_BYTES_PER_BYTE
    store._indexes.max_bytes = 2 * size + size // 2  # room for two
    for user in ("ann", "bob", "ann", "cyd"):  # ann used again: bob is the least recent
        store.list(user)
    assert len(store._indexes) == 2 and store._indexes.nbytes <= store._indexes.max_bytes
    assert store._indexes.get(str(store.user_dir("bob") / "index.json"), None) is None
    cached = {str(key) for key in store._indexes._entries}
    assert cached == {str(store.user_dir(u) / "index.json") for u in ("ann", "cyd")}


def test_a_rewritten_index_replaces_its_old_entry(tmp_path):
    store = _disk(tmp_path, 1)
    store.list("ann")
    before = store._indexes.nbytes
    store.put("ann", make_facts(1))
    store.list("ann")
    assert len([k for k in store._indexes._entries if "ann" in str(k)]) == 1
    assert store._indexes.nbytes >= before


def test_the_bound_is_the_stores_option_and_is_checked(tmp_path):
    config = Config.from_dict({"data_dir": str(tmp_path), "store": {"name": "disk", "options": {"index_cache_mib": 8}}})
    assert store_of_record(config)._indexes.max_bytes == 8 << 20
    assert DiskStore(DiskStore.Options(root=str(tmp_path / "x")))._indexes.max_bytes == 256 << 20
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="index_cache_mib"):
            DiskStore.Options(root=str(tmp_path), index_cache_mib=bad)


def test_one_index_larger_than_the_bound_is_not_kept(tmp_path):
    cache = IndexCache(max_bytes=100)
    cache.put("k", "tag", object(), 21)  # 105 bytes counted
    assert len(cache) == 0 and cache.nbytes == 0


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis-cache")).start()
    yield server
    server.stop()


def test_the_redis_stores_cache_is_bounded_too(redis):
    store = build("kv_store", BackendSpec("redis", {"url": redis.url, "prefix": "cachebound", "index_cache_mib": 1}))
    try:
        for user in ("ann", "bob", "cyd"):
            store.put(user, make_facts(3))
        size = len(store.client.hget(store.user_key("ann"), "index")) * PARSED_BYTES_PER_BYTE
        store._indexes.max_bytes = 2 * size + size // 2
        for user in ("ann", "bob", "ann", "cyd"):
            store.list(user)
        assert set(store._indexes._entries) == {"ann", "cyd"}
        assert store._indexes.nbytes <= store._indexes.max_bytes
    finally:
        keys = store.client.keys("cachebound:*")
        if keys:
            store.client.delete(*keys)
