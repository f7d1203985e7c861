"""Blending injection and recompute: which tokens are claimed, per-request overrides, key scale."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.compose.blend import AUTO_RECOMPUTE_TOKENS, Blend, injected_length, resolve_recompute_tokens
from inferscale.compose.rope import RotaryEmbedding
from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER
from inferscale.config import Config
from inferscale.inject.loader import LoadSpec, SegmentLoader, kv_head_range, load_blocks, slots_in
from inferscale.compose.request import SegmentRequest, make_params
from inferscale.compose.salt import CacheSalts
from inferscale.inject.planner import plan_request
from inferscale.inject.report import Fallback
from inferscale.errors import ConfigError
from inferscale.kv import FactKV
from inferscale.storage.disk import DiskStore
from inferscale.storage.pinned import PinnedHostStore

from small_store import ann_store, random_fact

SALTS = CacheSalts(b"s" * 32)


@given(parts=st.lists(st.integers(1, 40), min_size=1, max_size=30), budget=st.integers(0, 600))
@settings(max_examples=300, deadline=None)
def test_the_tail_left_to_vllm_is_the_longest_run_of_whole_facts_in_budget(parts, budget):
    claim = injected_length(parts, budget)
    total = sum(parts)
    assert parts[0] <= claim <= total  # the prefix is always injected
    tail = total - claim
    assert tail <= budget
    # the tail ends exactly on a fact boundary and is whole facts
    boundaries = {sum(parts[:i]) for i in range(1, len(parts) + 1)}
    assert claim in boundaries
    # maximal: one more fact would not fit (or there is none)
    facts_in_tail = sum(1 for i in range(1, len(parts)) if sum(parts[:i]) >= claim)
    if facts_in_tail < len(parts) - 1:
        assert tail + parts[len(parts) - 1 - facts_in_tail] > budget


def test_budget_extremes():
    assert injected_length([5, 10, 10], 0) == 25
    assert injected_length([5, 10, 10], 9) == 25  # the last fact does not fit whole
    assert injected_length([5, 10, 10], 10) == 15
    assert injected_length([5, 10, 10], 10_000) == 5  # only the prefix: prompt injection
    assert injected_length([7], 100) == 7


def test_auto_budget_follows_the_device():
    assert resolve_recompute_tokens("auto", "cuda") == AUTO_RECOMPUTE_TOKENS["cuda"]
    assert resolve_recompute_tokens("auto", "cpu") == AUTO_RECOMPUTE_TOKENS["cpu"]
    assert resolve_recompute_tokens("auto", "cpu") < resolve_recompute_tokens("auto", "cuda")
    assert resolve_recompute_tokens(64, "cuda") == 64
    assert Config(recompute_tokens=12, key_scale=1.1).blend("cuda") == Blend(12, 1.1)
    for bad in (-1, "lots", 2.5, True):
        with pytest.raises(ConfigError):
            Config(recompute_tokens=bad)
    with pytest.raises(ConfigError):
        Config(key_scale=0.0)
    with pytest.raises(ConfigError):
        Config(fact_style="numbered")


def test_request_values_override_the_connector_defaults():
    assert Blend(256, 1.0).override(None, None) == Blend(256, 1.0)
    assert Blend(256, 1.0).override(0, 1.25) == Blend(0, 1.25)


# ---------------------------------------------------------------- the planner


@pytest.fixture
def disk(tmp_path) -> DiskStore:
    return ann_store(tmp_path / "kv")


def _segment(disk: DiskStore, facts) -> list[int]:
    (prefix,) = disk.token_ids(SYSTEM_USER, [PREFIX_FACT])
    return [*prefix, *(t for ids in disk.token_ids("ann", facts) for t in ids)]


def _salt(disk: DiskStore, segment, recompute_tokens=None, salts=SALTS) -> str:
    return salts.segment("ann", disk.epoch("ann"), segment, recompute_tokens)


def test_planner_claims_the_head_and_leaves_the_tail(disk):
    order = ["a", "b", "c"]
    segment = _segment(disk, order)
    prompt = segment + [7, 8, 9]
    plan = plan_request(disk, SALTS, prompt, make_params("ann", order), _salt(disk, segment), 0, Blend(8))
    assert (plan.fallback, plan.segment_len, plan.claim_len) == (None, 18, 10)  # b and c (8 tokens) recomputed
    assert plan.num_external == 10 and plan.recomputed == 8
    # a request's own budget wins, and its salt must say so
    params = make_params("ann", order, recompute_tokens=0)
    plan = plan_request(disk, SALTS, prompt, params, _salt(disk, segment, 0), 0, Blend(8))
    assert (plan.fallback, plan.claim_len, plan.recomputed) == (None, 18, 0)
    # ... a salt made without the request's recipe is refused: other K/V must not share its cache
    plan = plan_request(disk, SALTS, prompt, params, _salt(disk, segment), 0, Blend(8))
    assert plan.fallback is not None and plan.num_external == 0
    # vLLM's prefix cache already holds part of the claim: load only the rest
    plan = plan_request(disk, SALTS, prompt, make_params("ann", order), _salt(disk, segment), 4, Blend(8))
    assert (plan.claim_len, plan.num_external) == (10, 6)
    # a nonce after the salt is accepted (no prefix-cache reuse); anything else is not
    plan = plan_request(disk, SALTS, prompt, make_params("ann", order), _salt(disk, segment) + ":n1", 0, Blend(8))
    assert plan.fallback is None
    for salt in (_salt(disk, segment) + "x", _salt(disk, segment)[:-1], None, 7):
        assert plan_request(disk, SALTS, prompt, make_params("ann", order), salt, 0, Blend(8)).fallback is not None


def test_planner_refuses_salts_it_did_not_key(disk):
    """Another key, or the same key before the user's memory changed: refused."""
    order = ["a", "b", "c"]
    segment = _segment(disk, order)
    prompt, params = segment + [7, 8, 9], make_params("ann", order)
    assert plan_request(disk, SALTS, prompt, params, _salt(disk, segment), 0).fallback is None
    foreign = _salt(disk, segment, salts=CacheSalts(b"t" * 32))
    assert plan_request(disk, SALTS, prompt, params, foreign, 0).fallback == "missing_cache_salt"
    stale = _salt(disk, segment)
    disk.put("ann", {"d": random_fact(2, 4)})  # any write renews the user's epoch
    plan = plan_request(disk, SALTS, prompt, params, stale, 0)
    assert plan.fallback == "missing_cache_salt" and plan.num_external == 0


#: the segment of ``a, b, c`` (18 tokens): the prefix's 4, then a's 6, b's 5 and c's 3
SEGMENT_LEN, BOUNDARIES = 18, (4, 10, 15)


@pytest.mark.parametrize("at", range(SEGMENT_LEN))
def test_a_prompt_that_differs_from_the_segment_at_any_token_is_refused(disk, at):
    """One token changed anywhere (the first, either side of a fact boundary, the last) and nothing
    is claimed, whether the request carries the segment's salt or one made over its own head: the
    salt is checked over the prompt's head first, so a changed token never reaches the store."""
    order = ["a", "b", "c"]
    segment = _segment(disk, order)
    (prefix,) = disk.token_ids(SYSTEM_USER, [PREFIX_FACT])
    parts = [len(prefix), *(len(ids) for ids in disk.token_ids("ann", order))]
    assert list(itertools.accumulate(parts)) == [*BOUNDARIES, SEGMENT_LEN] == [*BOUNDARIES, len(segment)]
    prompt = [*segment, 7, 8, 9]
    prompt[at] += 1
    for salt in (_salt(disk, segment), _salt(disk, prompt[:SEGMENT_LEN])):
        plan = plan_request(disk, SALTS, prompt, make_params("ann", order), salt, 0, Blend(8))
        assert (plan.fallback, plan.claim_len, plan.num_external) == (Fallback.MISSING_CACHE_SALT, 0, 0)
    # the same prompt unchanged is claimed: the refusal was the changed token's
    plan = plan_request(disk, SALTS, [*segment, 7, 8, 9], make_params("ann", order), _salt(disk, segment), 0,
                        Blend(8))
    assert plan.fallback is None and plan.num_external > 0


@pytest.mark.parametrize("boundary", BOUNDARIES)
@pytest.mark.parametrize("shift", ["dropped", "doubled"])
def test_a_token_dropped_or_doubled_at_a_fact_boundary_is_refused(disk, boundary, shift):
    order = ["a", "b", "c"]
    segment = _segment(disk, order)
    head, tail = segment[:boundary], segment[boundary:]
    prompt = head + (tail[1:] if shift == "dropped" else [head[-1], *tail]) + [7, 8, 9]
    plan = plan_request(disk, SALTS, prompt, make_params("ann", order), _salt(disk, segment), 0, Blend(8))
    assert (plan.fallback, plan.num_external) == (Fallback.MISSING_CACHE_SALT, 0)


def test_a_prompt_needs_one_token_past_the_segment(disk):
    """The segment whole and nothing after it: vLLM must compute at least one token itself."""
    order = ["a", "b", "c"]
    segment = _segment(disk, order)
    params, salt = make_params("ann", order), _salt(disk, segment)
    plan = plan_request(disk, SALTS, segment, params, salt, 0, Blend(0))
    assert (plan.fallback, plan.num_external) == (Fallback.PROMPT_TOO_SHORT, 0)
    plan = plan_request(disk, SALTS, segment[:-1], params, salt, 0, Blend(0))  # its head is not the segment
    assert (plan.fallback, plan.num_external) == (Fallback.MISSING_CACHE_SALT, 0)
    plan = plan_request(disk, SALTS, [*segment, 7], params, salt, 0, Blend(0))
    assert (plan.fallback, plan.claim_len, plan.num_external) == (None, SEGMENT_LEN, SEGMENT_LEN)


# ---------------------------------------------------------------- the worker's loader


def _loader(disk: DiskStore) -> SegmentLoader:
    rope = RotaryEmbedding(1.0 / (10_000 ** (torch.arange(0, 8, 2).float() / 8)), 8)
    return SegmentLoader(PinnedHostStore(PinnedHostStore.Options()), disk, rope,
                         kv_head_range(2, 1, 0), "cpu", torch.float32)


def _spec(disk, order, start, end, key_scale=1.0, recompute=None) -> LoadSpec:
    """A load as the scheduler sends it for the memory on disk now."""
    segment = _segment(disk, order)
    memory = SegmentRequest("ann", tuple(order), recompute, None)
    epochs = (disk.epoch(SYSTEM_USER), disk.epoch("ann"))
    blocks = load_blocks(range(len(segment) // 4 + 1), 4, start, end)  # slot = position
    return LoadSpec("r1", memory, start, end, len(segment), blocks, 4, epochs, key_scale)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 16, 32]), st.lists(st.integers(0, 10_000), min_size=1, max_size=40), st.data())
def test_slots_follow_the_block_table(block_size, block_ids, data):
    """Token position p of the request lands in slot block_ids[p // block_size] * block_size + p % block_size."""
    end = data.draw(st.integers(0, len(block_ids) * block_size))
    start = data.draw(st.integers(0, end))
    blocks = load_blocks(block_ids, block_size, start, end)
    slots = slots_in(blocks, block_size, start, end)
    assert slots.dtype.name == "int64"
    assert slots.tolist() == [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
    assert set(blocks) == {s // block_size for s in slots.tolist()}
    past = len(block_ids) * block_size + 1
    with pytest.raises(IndexError):  # past the block table
        slots_in(load_blocks(block_ids, block_size, start, past), block_size, start, past)


def test_key_scale_multiplies_only_the_facts_keys(disk):
    order = ["a", "b", "c"]
    loader = _loader(disk)
    plain = loader.load(_spec(disk, order, 0, 18), num_layers=2, head_size=8)
    scaled = loader.load(_spec(disk, order, 0, 18, key_scale=1.25), num_layers=2, head_size=8)
    assert torch.equal(scaled.keys[:, :4], plain.keys[:, :4])  # the instruction prefix is exact: untouched
    torch.testing.assert_close(scaled.keys[:, 4:], plain.keys[:, 4:] * 1.25)
    assert torch.equal(scaled.values, plain.values)
    # a load that starts inside the facts (prefix already in vLLM's cache) scales all it loads
    tail = loader.load(_spec(disk, order, 6, 10, key_scale=1.25), num_layers=2, head_size=8)
    torch.testing.assert_close(tail.keys, plain.keys[:, 6:10] * 1.25)


def test_loader_writes_only_the_claimed_head(disk):
    order = ["a", "b", "c"]
    loader = _loader(disk)
    whole = loader.load(_spec(disk, order, 0, 18), num_layers=2, head_size=8)
    head = loader.load(_spec(disk, order, 0, 10, recompute=8), num_layers=2, head_size=8)
    assert head.token_ids == whole.token_ids[:10]
    torch.testing.assert_close(head.keys, whole.keys[:, :10])
    with pytest.raises(ValueError):
        loader.load(_spec(disk, order, 0, 19), num_layers=2, head_size=8)


def test_loader_never_writes_another_version_of_the_memory(disk):
    """A fact re-encoded under the same token ids after a request was scheduled: that request
    gets the version its salt names while the memory tier still holds it, and is refused once
    the tier holds only the new one; a request scheduled after the write gets the new K/V."""
    order = ["a", "b", "c"]
    loader = _loader(disk)
    scheduled = _spec(disk, order, 0, 18)
    before = loader.load(scheduled, num_layers=2, head_size=8)  # the memory tier now holds this version
    a = disk.load_user("ann")["a"]
    disk.put("ann", {"a": FactKV(a.token_ids, a.keys + 1, a.values)})
    assert torch.equal(loader.load(scheduled, num_layers=2, head_size=8).keys, before.keys)
    now = _spec(disk, order, 0, 18)
    assert now.epochs != scheduled.epochs
    segment = loader.load(now, num_layers=2, head_size=8)  # a stale tier fails the version check: reloaded
    expected = _loader(disk).load(now, num_layers=2, head_size=8)
    assert torch.equal(segment.keys, expected.keys) and not torch.equal(segment.keys, before.keys)
    with pytest.raises(ValueError, match="changed"):  # the old version is gone from every tier
        loader.load(scheduled, num_layers=2, head_size=8)


@pytest.mark.own_process
def test_fused_sources_follow_a_new_instruction_prefix(disk):
    """The loader looks the prefix up once per version of it: a request scheduled after the
    prefix changed reads the new prefix's K/V, one scheduled before it is refused once the old
    prefix is gone."""
    import ctypes

    from inferscale.inject.sources import K_ADDR

    order = ["a"]
    loader = _loader(disk)
    before = _spec(disk, order, 0, 10)
    loader.sources(before, num_layers=2, head_size=8)  # the memory tier holds the first prefix
    new_prefix = random_fact(4, 7)
    disk.put(SYSTEM_USER, {PREFIX_FACT: new_prefix})
    after = _spec(disk, order, 0, 10)
    sources = loader.sources(after, num_layers=2, head_size=8)
    first_key = (ctypes.c_float * 16).from_address(int(sources.table[K_ADDR][0]))
    assert torch.equal(torch.tensor(list(first_key)).view(2, 8), new_prefix.keys[0, 0])
    with pytest.raises(ValueError, match="changed since"):
        loader.sources(before, num_layers=2, head_size=8)


@pytest.mark.own_process
def test_fused_sources_point_at_the_segments_stored_rows(disk):
    """What the fused kernel reads (raw addresses into the store's blocks) is the segment's
    pre-RoPE K/V, token for token, layer for layer; and it is checked as load() is."""
    import ctypes

    from inferscale.compose.segment import gather_segment
    from inferscale.inject.sources import K_ADDR, LAYER_STRIDE, POSITION, SCALE, SLOT, V_ADDR

    order = ["a", "b", "c"]
    loader = _loader(disk)
    spec = _spec(disk, order, 6, 18, key_scale=1.25)
    sources = loader.sources(spec, num_layers=2, head_size=8)
    batch = gather_segment(loader.store, "ann", order)
    # positions 6..17; keys scaled from the first fact's token on, the prefix's not
    assert sources.table[POSITION].tolist() == list(range(6, 18))
    first_fact = max(0, batch.offsets[1] - 6)  # this segment starts inside the facts
    scales = sources.table[SCALE].to(torch.int32).view(torch.float32)
    assert scales.tolist() == [1.0] * first_fact + [1.25] * (12 - first_fact)
    row = batch.keys.shape[2] * batch.keys.shape[3]

    def read(address: int) -> torch.Tensor:
        return torch.tensor(list((ctypes.c_float * row).from_address(address))).view(batch.keys.shape[2:])

    for t in range(12):
        for layer in range(2):
            step = int(sources.table[LAYER_STRIDE][t]) * layer * 4
            assert torch.equal(read(int(sources.table[K_ADDR][t]) + step), batch.keys[layer, 6 + t])
            assert torch.equal(read(int(sources.table[V_ADDR][t]) + step), batch.values[layer, 6 + t])
    with pytest.raises(ValueError):
        loader.sources(_spec(disk, order, 0, 19), num_layers=2, head_size=8)
    forged = LoadSpec("r1", spec.request, 6, 18, spec.segment_len, spec.blocks, spec.block_size,
                      (spec.epochs[0], "other"), 1.25)
    with pytest.raises(ValueError, match="changed since"):
        loader.sources(forged, num_layers=2, head_size=8)
    assert sources.table[SLOT].tolist() == spec.slots.tolist() == list(range(6, 18))  # (slot = position here)
    for blocks, size in ((spec.blocks[:-1], spec.block_size), ([*spec.blocks, 99], spec.block_size), (spec.blocks, 0)):
        bad = LoadSpec("r1", spec.request, 6, 18, spec.segment_len, blocks, size, spec.epochs, 1.25)
        for read in (loader.sources, loader.load):  # never a slot guessed past the blocks the scheduler sent
            with pytest.raises(ValueError, match="cache blocks"):
                read(bad, num_layers=2, head_size=8)
