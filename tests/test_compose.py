"""Composer order and the memory segment, without vLLM."""

import pytest
import torch

from inferscale import BackendSpec, build
from inferscale.compose.rope import RotaryEmbedding
from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER, compose_segment, gather_segment, segment_parts
from inferscale.kv import FactKV
from inferscale.retrieval.base import Hit
from inferscale.storage.disk import DiskStore
from inferscale.storage.pinned import PinnedHostStore

L, H, D = 3, 2, 16


def kv(ids, seed):
    g = torch.Generator().manual_seed(seed)
    return FactKV(ids, torch.randn(L, len(ids), H, D, generator=g), torch.randn(L, len(ids), H, D, generator=g))


@pytest.fixture
def store(tmp_path):
    disk = DiskStore(DiskStore.Options(root=str(tmp_path)))
    disk.put(SYSTEM_USER, {PREFIX_FACT: kv([1, 2, 3], 0)})
    disk.put("ann", {"a": kv([10, 11], 1), "b": kv([20], 2), "c": kv([30, 31, 32], 3)})
    return disk


@pytest.mark.parametrize("most_relevant, expected", [("last", ["c", "a", "b"]), ("first", ["b", "a", "c"])])
def test_relevance_order(most_relevant, expected):
    composer = build("composer", BackendSpec("relevance", {"most_relevant": most_relevant}))
    assert composer.order([Hit("a", 0.5), Hit("b", 0.9), Hit("c", 0.1)]) == expected


def test_ties_break_by_fact_id():
    composer = build("composer", BackendSpec("relevance"))
    assert composer.order([Hit("y", 0.5), Hit("x", 0.5)]) == ["y", "x"]


def test_segment_is_prefix_then_facts_in_order(store):
    epochs, parts = segment_parts(store, "ann", ["c", "a"])
    assert [t for part in parts for t in part] == [1, 2, 3, 30, 31, 32, 10, 11]
    assert epochs == (store.epoch(SYSTEM_USER), store.epoch("ann"))
    batch = gather_segment(store, "ann", ["c", "a"])
    assert batch.keys.shape == (L, 8, H, D)
    assert torch.equal(batch.values[:, 3:6], store.get("ann", ["c"]).values)


def test_composed_keys_are_rotated_at_segment_positions(store):
    rope = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)), D)
    segment = compose_segment(store, rope, "ann", ["b", "a"])
    assert segment.token_ids == [1, 2, 3, 20, 10, 11]
    raw = gather_segment(store, "ann", ["b", "a"])
    expected = rope.rotate(raw.keys, torch.arange(6))
    assert torch.allclose(segment.keys, expected)
    assert torch.equal(segment.values, raw.values)  # RoPE never touches values
    # the same fact lands at a different offset in another order: only its rotation changes
    other = compose_segment(store, rope, "ann", ["a", "b"])
    assert torch.allclose(rope.inverse(other.keys[:, 3:5], torch.arange(3, 5)),
                          rope.inverse(segment.keys[:, 4:6], torch.arange(4, 6)), atol=1e-5)


def test_segment_from_memory_tier_equals_disk(store):
    memory = PinnedHostStore(PinnedHostStore.Options())
    for user in (SYSTEM_USER, "ann"):
        memory.put(user, store.load_user(user))
    a, b = gather_segment(store, "ann", ["a", "c"]), gather_segment(memory, "ann", ["a", "c"])
    assert torch.equal(a.keys, b.keys) and a.token_ids == b.token_ids
