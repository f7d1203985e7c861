"""The write policy (inject/writer.py), on the CPU: each layer through the backend's op, failed
loads reported, and a fused write that cannot run says so once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from inferscale.compose.request import SegmentRequest
from inferscale.compose.rope import RotaryEmbedding
from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER
from inferscale.config import Config, Tuning
from inferscale.inject import fused_write, sources
from inferscale.inject.loader import LoadSpec, SegmentLoader, kv_head_range, load_blocks
from inferscale.inject.stats import ConnectorStats
from inferscale.inject.writer import KVWriter
from inferscale.storage.disk import DiskStore
from inferscale.storage.pinned import PinnedHostStore
from inferscale.storage.tiers import Tiers
from test_storage import make_fact, make_facts

LAYERS, SIZE = 2, 8


class RecordingCache:
    """A paged cache that records each layer's writes (and has no layout the fused write knows)."""

    def __init__(self):
        self.writes: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.asked = 0

    def views(self):
        self.asked += 1
        raise ValueError("attention backend TorchSDPABackendImpl (known: FlashAttentionImpl)")

    def write(self, layer, key, value, slots):
        self.writes.append((layer, key, value, slots))


@pytest.fixture
def tiers(tmp_path) -> Tiers:
    disk = DiskStore(DiskStore.Options(root=str(tmp_path / "kv")))
    disk.put(SYSTEM_USER, {PREFIX_FACT: make_fact(5, layers=LAYERS, size=SIZE, seed=999)})
    disk.put("ann", make_facts(3, layers=LAYERS, size=SIZE))
    return Tiers(PinnedHostStore(PinnedHostStore.Options(device="cpu")), disk)


def spec_for(disk: DiskStore, user: str, req_id: str = "r", epochs=None) -> LoadSpec:
    request = SegmentRequest(user, tuple(disk.list(user)), 0, None)
    length = sum(map(len, disk.token_ids(SYSTEM_USER, [PREFIX_FACT]) + disk.token_ids(user, request.fact_ids)))
    epochs = epochs or (disk.epoch(SYSTEM_USER), disk.epoch(user))
    return LoadSpec(req_id, request, 0, length, length, load_blocks(range(length), 1, 0, length), 1, epochs)


def writer_for(tiers: Tiers, **tuning) -> tuple[KVWriter, ConnectorStats]:
    rope = RotaryEmbedding(1.0 / (10_000 ** (torch.arange(0, SIZE, 2).float() / SIZE)), SIZE)
    stats = ConnectorStats()
    writer = KVWriter(Config(tuning=Tuning(**tuning)), tiers, rope, kv_head_range(2, 1, 0), SIZE, stats)
    writer.register(LAYERS, torch.device("cpu"), torch.float32)
    return writer, stats


def test_each_layer_is_written_through_the_backend_op(tiers):
    writer, stats = writer_for(tiers)
    spec = spec_for(tiers.record, "ann")
    cache = RecordingCache()
    writer.write_step([spec], cache, waits_per_layer=False)
    expected = SegmentLoader(tiers.memory, tiers.record, writer.rope, writer.heads, "cpu", torch.float32).load(
        spec, LAYERS, SIZE)
    assert [layer for layer, *_ in cache.writes] == list(range(LAYERS))
    for layer, key, value, slots in cache.writes:
        assert torch.equal(key, expected.keys[layer]) and torch.equal(value, expected.values[layer])
        assert slots.tolist() == spec.slots.tolist()
    assert stats.snapshot()["store_hit.disk"] == 1  # first use: loaded from the disk tier
    writer.write_step([spec], cache)
    assert stats.snapshot()["store_hit.pinned"] == 1
    assert stats.snapshot()["load_steps.resident"] == 2  # on a CPU nothing crosses a bus
    assert writer.take_load_errors() == set()


def test_each_load_counts_the_tier_that_served_it_and_the_bytes_it_read_there(tiers):
    """The first load reads the whole user from the store of record, the next the written tokens from
    the memory tier; once the user is written again (another process), the memory tier's copy is
    another version and the load is the store of record's again."""
    writer, stats = writer_for(tiers)
    token_bytes = LAYERS * 2 * 2 * SIZE * 4  # K and V, 2 heads, float32

    def counted(spec: LoadSpec) -> dict:
        writer.write_step([spec], RecordingCache())
        counts = stats.take()
        counts.pop("host_seconds.load")
        assert counts.pop("load_steps.resident") == 1  # a step of its own
        return counts

    first = spec_for(tiers.record, "ann")
    assert counted(first) == {"store_hit.disk": 1, "store_bytes.disk": tiers.record.nbytes("ann")}
    assert counted(spec_for(tiers.record, "ann", "again")) == {"store_hit.pinned": 1,
                                                              "store_bytes.pinned": first.end * token_bytes}
    tiers.record.put("ann", {"f9": make_fact(4, layers=LAYERS, size=SIZE, seed=9)})
    grown = tiers.record.nbytes("ann")
    assert grown > tiers.memory.nbytes("ann")  # (the memory tier still holds the version before)
    assert counted(spec_for(tiers.record, "ann", "written")) == {"store_hit.disk": 1, "store_bytes.disk": grown}
    assert writer.take_load_errors() == set()


def test_a_failed_load_reports_its_blocks_and_the_others_are_written(tiers):
    writer, _ = writer_for(tiers)
    good = spec_for(tiers.record, "ann")
    stale = spec_for(tiers.record, "ann", "stale", epochs=("old", "old"))
    cache = RecordingCache()
    writer.write_step([stale, good], cache)
    assert writer.take_load_errors() == set(stale.blocks)
    assert len(cache.writes) == LAYERS and writer.take_load_errors() == set()


def test_a_fused_write_that_cannot_run_says_why_once(tiers, monkeypatch, caplog):
    monkeypatch.setattr(fused_write, "available", lambda: True)
    monkeypatch.setattr(sources, "ready", lambda: True)  # (no Numba compiled in this process)
    writer, _ = writer_for(tiers)
    cache = RecordingCache()
    with caplog.at_level(logging.WARNING, logger="vllm.inferscale.connector"):
        for _ in range(3):
            writer.write_step([spec_for(tiers.record, "ann")], cache)
    off = [r.getMessage() for r in caplog.records if "fused cache write is off" in r.getMessage()]
    assert len(off) == 1 and "TorchSDPABackendImpl" in off[0] and cache.asked == 1
    assert len(cache.writes) == 3 * LAYERS  # each step written layer by layer instead


def test_a_fused_write_turned_off_in_the_config_stays_quiet(tiers, monkeypatch, caplog):
    monkeypatch.setattr(fused_write, "available", lambda: True)
    monkeypatch.setattr(sources, "ready", lambda: True)
    writer, _ = writer_for(tiers, fused_write=False)
    cache = RecordingCache()
    with caplog.at_level(logging.WARNING):
        writer.write_step([spec_for(tiers.record, "ann")], cache)
    assert cache.asked == 0 and "fused cache write" not in caplog.text


class FlashAttentionCache:
    """Caches in vLLM 0.26 FlashAttention's layout on the CPU, which the fused write addresses."""

    def __init__(self, num_blocks: int, heads: int, block_size: int, head_size: int):
        from test_fused_write import flash_attention_views

        self.layers = [flash_attention_views(num_blocks, heads, block_size, head_size, torch.float32, "cpu")
                       for _ in range(LAYERS)]

    def views(self):
        return [(key, value) for _, key, value in self.layers]

    def write(self, layer, key, value, slots):
        raise AssertionError("the fused write was to write every layer")


def check_fused_step(tmp_path: str) -> None:
    """Two requests of one step, written by the fused kernel (under Triton's interpreter: host
    memory, so a launch per group of layers), land at their slots as the per-layer path's K/V."""
    assert fused_write.available() and sources.ready()
    disk = DiskStore(DiskStore.Options(root=str(Path(tmp_path) / "kv")))
    disk.put(SYSTEM_USER, {PREFIX_FACT: make_fact(5, layers=LAYERS, size=SIZE, seed=999)})
    disk.put("ann", make_facts(3, layers=LAYERS, size=SIZE))
    tiers = Tiers(PinnedHostStore(PinnedHostStore.Options(device="cpu")), disk)
    writer, stats = writer_for(tiers, pinned_read_launches=2)
    first = spec_for(disk, "ann")
    length = first.end
    second = LoadSpec("s", first.request, 3, length, length, load_blocks(range(100, 200), 4, 3, length), 4,
                      first.epochs)
    first = LoadSpec("r", first.request, 0, length, length, load_blocks(range(length), 4, 0, length), 4,
                     first.epochs)
    cache = FlashAttentionCache(200, 2, 4, SIZE)
    writer.write_step([first, second], cache)
    assert writer.take_load_errors() == set()
    counted = stats.snapshot()
    assert counted.pop("host_seconds.load") > 0  # the step's loads were timed
    # the first loaded the whole user into the memory tier, the second read its tokens there
    assert counted == {"store_hit.disk": 1, "store_hit.pinned": 1, "store_bytes.disk": disk.nbytes("ann"),
                       "store_bytes.pinned": (length - 3) * LAYERS * 2 * 2 * SIZE * 4, "load_steps.resident": 1}
    for spec in (first, second):
        expected = writer.loader.load(spec, LAYERS, SIZE)
        for layer, (_, key, value) in enumerate(cache.layers):
            slots = torch.from_numpy(spec.slots)
            got_k, got_v = key[slots // 4, slots % 4], value[slots // 4, slots % 4]
            assert torch.allclose(got_k, expected.keys[layer], atol=1e-5), (spec.req_id, layer)
            assert torch.equal(got_v, expected.values[layer]), (spec.req_id, layer)


def test_the_fused_write_of_a_step_lands_where_the_per_layer_write_would(tmp_path):
    from test_fused_write import run_interpreted

    run_interpreted(f"import test_writer as t; t.check_fused_step({str(tmp_path)!r})")
