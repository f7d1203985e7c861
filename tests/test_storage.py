"""KV stores: exact round trips, bookkeeping and errors for every store; the memory
stores; tiering. The disk store's format, durability and corruption: test_disk.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferscale import hookimpl
from inferscale.config import BackendSpec, Config, build
from inferscale.errors import (
    ConfigError,
    MissingFactError,
    ModelMismatchError,
    UnknownBackendError,
    UnknownUserError,
)
from inferscale.kv import FactKV
from inferscale.plugins import backends, pm
from inferscale.storage import DiskStore, HBMStore, KVStore, PinnedHostStore
from inferscale.storage.tiers.memory import MemoryTier, check_memory_tier, missing_from_contract
from inferscale.storage.tiers.fill import ensure_user
from inferscale.storage.tiers import build_tiers

REPO = Path(__file__).resolve().parents[1]
try:
    import inferscale_mmap  # noqa: F401  (the plugin tier: pip install ./plugins/inferscale-mmap)
except ImportError:
    inferscale_mmap = None
#: every memory tier: the built-ins and a third-party one (plugins/inferscale-mmap)
MEMORY_TIERS = ["hbm", "pinned", pytest.param("mmap", marks=pytest.mark.skipif(
    inferscale_mmap is None, reason="pip install ./plugins/inferscale-mmap"))]
STORES = [*MEMORY_TIERS, "disk"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CUDA = torch.cuda.is_available()


def make_fact(tokens: int, *, layers: int = 3, heads: int = 2, size: int = 8, dtype=torch.float32, seed: int = 0) -> FactKV:
    """Random K/V (never zeros) with distinct token ids."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(layers, tokens, heads, size, generator=gen).to(dtype)
    values = torch.randn(layers, tokens, heads, size, generator=gen).to(dtype)
    return FactKV(tuple(range(seed * 1000, seed * 1000 + tokens)), keys, values)


def make_facts(n: int, dtype=torch.float32, **shape) -> dict[str, FactKV]:
    return {f"f{i}": make_fact(1 + (i * 3) % 7, dtype=dtype, seed=i + 1, **shape) for i in range(n)}


def make_store(name: str, root: Path) -> KVStore:
    options = {"disk": {"root": str(root)}, "mmap": {"directory": str(root / "mapped")}}.get(name, {})
    return build("kv_store", BackendSpec(name, options))


@pytest.fixture(params=STORES)
def store(request, tmp_path) -> KVStore:
    return make_store(request.param, tmp_path / "kv")


def assert_batch(batch, facts, fact_ids, device=None):
    """Bitwise equality with a plain concatenation of the facts, in order (on ``device`` if named)."""
    want_k = torch.cat([facts[f].keys for f in fact_ids], dim=1)
    want_v = torch.cat([facts[f].values for f in fact_ids], dim=1)
    assert batch.fact_ids == list(fact_ids)
    assert batch.token_ids == [facts[f].token_ids for f in fact_ids]
    if device is not None:
        assert batch.keys.device.type == torch.device(device).type
    assert batch.values.device == batch.keys.device
    assert batch.keys.dtype == want_k.dtype and batch.values.dtype == want_v.dtype
    assert torch.equal(batch.keys.cpu(), want_k) and torch.equal(batch.values.cpu(), want_v)
    assert batch.keys.is_contiguous() and batch.values.is_contiguous()
    assert all(batch.keys[layer].is_contiguous() for layer in range(batch.keys.shape[0]))


# -- the KVStore contract, for every store -------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_exact(store, dtype):
    facts = make_facts(6, dtype)
    store.put("alice", facts)
    default = getattr(store, "device", torch.device("cpu"))  # memory stores: cuda when there is one
    for order in (["f0"], ["f3", "f1", "f5"], list(facts), ["f2", "f2", "f0", "f2"], list(reversed(facts))):
        assert_batch(store.get("alice", order), facts, order, default)
        assert_batch(store.get("alice", order, "cpu"), facts, order, "cpu")


def test_puts_merge_and_replace(store):
    first, second = make_facts(3), {"f1": make_fact(4, seed=40), "f9": make_fact(2, seed=41)}
    store.put("alice", first)
    store.put("alice", second)
    merged = {**first, **second}
    assert store.list("alice") == ["f0", "f1", "f2", "f9"]
    assert_batch(store.get("alice", list(merged)), merged, list(merged))


def test_token_ids_list_users_nbytes(store):
    facts = make_facts(4, torch.bfloat16)
    store.put("alice", facts)
    store.put("bob", make_facts(2, torch.bfloat16))
    assert store.list("alice") == list(facts)
    assert sorted(store.users()) == ["alice", "bob"]
    assert store.nbytes("alice") == sum(kv.nbytes for kv in facts.values())
    assert store.token_ids("alice", ["f3", "f0", "f3"]) == [facts["f3"].token_ids, facts["f0"].token_ids] + [
        facts["f3"].token_ids
    ]
    assert store.list("nobody") == [] and store.nbytes("nobody") == 0
    assert store.has_user("alice") and not store.has_user("nobody")


def test_delete_facts_then_user(store):
    facts = make_facts(4)
    store.put("alice", facts)
    store.put("bob", make_facts(1))
    store.delete("alice", ["f1", "f3", "never-stored"])
    assert store.list("alice") == ["f0", "f2"]
    assert store.nbytes("alice") == facts["f0"].nbytes + facts["f2"].nbytes
    assert_batch(store.get("alice", ["f2", "f0"]), facts, ["f2", "f0"])
    with pytest.raises(MissingFactError) as err:
        store.get("alice", ["f0", "f1"])
    assert err.value.missing == ["f1"]
    store.delete("alice")
    assert store.users() == ["bob"] and store.list("alice") == []
    with pytest.raises(UnknownUserError):
        store.get("alice", ["f0"])
    store.delete("alice")  # idempotent
    store.delete("bob", ["f0"])  # deleting the last fact forgets the user
    assert store.users() == []


def test_unknown_user_and_missing_facts(store):
    with pytest.raises(UnknownUserError, match="nobody"):
        store.get("nobody", ["f0"])
    with pytest.raises(UnknownUserError):
        store.token_ids("nobody", ["f0"])
    store.put("alice", make_facts(2))
    with pytest.raises(MissingFactError) as err:
        store.get("alice", ["f0", "x2", "x1", "x2"])
    assert err.value.missing == ["x1", "x2"] and "x1" in str(err.value)
    with pytest.raises(MissingFactError):
        store.token_ids("alice", ["nope"])


def test_empty_get(store):
    empty = store.get("nobody", [])
    assert empty.fact_ids == [] and empty.num_tokens == 0
    store.put("alice", make_facts(2, torch.float16, layers=5, heads=3, size=4))
    empty = store.get("alice", [])
    assert empty.keys.shape == (5, 0, 3, 4) and empty.values.shape == (5, 0, 3, 4)
    assert empty.keys.dtype == torch.float16 and empty.offsets == [0]


@pytest.mark.parametrize(
    "other",
    [dict(layers=4), dict(heads=1), dict(size=16), dict(dtype=torch.bfloat16)],
    ids=["layers", "heads", "head_size", "dtype"],
)
def test_model_mismatch(store, other):
    store.put("alice", make_facts(2))
    with pytest.raises(ModelMismatchError, match="'odd'"):
        store.put("alice", {"odd": make_fact(3, seed=9, **other)})
    with pytest.raises(ModelMismatchError):  # within one put, nothing is stored
        store.put("bob", {"a": make_fact(3), "odd": make_fact(3, seed=9, **other)})
    assert store.list("alice") == ["f0", "f1"] and store.list("bob") == []
    store.put("carol", {"odd": make_fact(3, seed=9, **other)})  # users are independent


def test_bad_ids_rejected(store):
    with pytest.raises(ValueError):
        store.put("alice\n", make_facts(1))
    with pytest.raises(ValueError):
        store.put("alice", {"a/b": make_fact(2)})


def test_store_owns_its_data(store):
    facts = make_facts(2)
    originals = {f: FactKV(kv.token_ids, kv.keys.clone(), kv.values.clone()) for f, kv in facts.items()}
    store.put("alice", facts)
    for kv in facts.values():
        kv.keys.fill_(7.0)
    batch = store.get("alice", ["f0"])
    batch.keys.fill_(3.0)
    assert_batch(store.get("alice", ["f0", "f1"]), originals, ["f0", "f1"])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(order=st.lists(st.sampled_from([f"f{i}" for i in range(8)]), min_size=1, max_size=20))
def test_any_order_with_duplicates(store, order):
    facts = make_facts(8, torch.bfloat16)
    if not store.has_user("alice"):
        store.put("alice", facts)
    assert_batch(store.get("alice", order), facts, order)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_get_onto_gpu(store, dtype):
    facts = make_facts(6, dtype)
    store.put("alice", facts)
    order = ["f4", "f0", "f4", "f5"]
    batch = store.get("alice", order, "cuda")
    torch.cuda.current_stream().synchronize()
    assert_batch(batch, facts, order, "cuda")
    assert_batch(store.get("alice", ["f1"], "cuda"), facts, ["f1"], "cuda")


# -- the memory stores ------------------------------------------------------------


def test_hbm_device_choice():
    assert HBMStore().device.type == ("cuda" if CUDA else "cpu")
    assert HBMStore(HBMStore.Options(device="cpu")).device == torch.device("cpu")
    if not CUDA:
        with pytest.raises(ConfigError):
            HBMStore(HBMStore.Options(device="cuda"))


def test_pinned_packs_each_user_into_one_buffer():
    store = PinnedHostStore()
    assert store.pinned == CUDA
    store.put("alice", make_facts(3))
    store.put("alice", {"f9": make_fact(5, seed=50)})
    store.delete("alice", ["f1"])
    blocks = store._users["alice"].blocks
    buffers = {block.untyped_storage().data_ptr() for block in blocks.values()}
    assert len(buffers) == 1 and all(block.is_contiguous() for block in blocks.values())
    assert all(block.is_pinned() == CUDA for block in blocks.values())


@pytest.mark.parametrize("name", MEMORY_TIERS)
def test_held_rows_pick_the_facts_blocks_in_request_order(name, tmp_path):
    """The fused write's view of a request's facts: the user's blocks, and rows among them that
    pick the same blocks, addresses and lengths as inspecting each block, in the request's order;
    a put renews them (new blocks, new table)."""
    from inferscale.storage.blocks import HeldBlocks

    store = make_store(name, tmp_path)
    facts = make_facts(6)
    store.put("alice", facts)
    order = ["f4", "f0", "f5", "f2"]
    held, rows = store.held_rows("alice", order, "cpu")
    picked = held.select(rows)
    inspected = HeldBlocks.of(store.blocks("alice", order, "cpu"))
    assert len(held.blocks) == 6 and rows.dtype == np.int64
    assert [b.data_ptr() for b in picked.blocks] == picked.addresses.tolist() == inspected.addresses.tolist()
    assert picked.lengths.tolist() == [facts[f].num_tokens for f in order] == inspected.lengths.tolist()
    assert held.layout == inspected.layout
    for block, fact_id in zip(picked.blocks, order):
        assert torch.equal(block[0], facts[fact_id].keys) and torch.equal(block[1], facts[fact_id].values)
    assert store.held_rows("alice", [], "cpu")[1].tolist() == []
    with pytest.raises(MissingFactError, match="nope"):
        store.held_rows("alice", ["f0", "nope"], "cpu")
    store.put("alice", {"f0": make_fact(4, seed=99)})
    again, rows = store.held_rows("alice", ["f0"], "cpu")
    assert torch.equal(again.blocks[rows[0]][0], make_fact(4, seed=99).keys) and again.lengths[rows].tolist() == [4]


@settings(max_examples=60, deadline=None)
@given(picks=st.lists(st.integers(0, 7), min_size=1, max_size=12), deleted=st.sets(st.integers(0, 7), max_size=3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_copy_rows_packs_any_pick_of_a_users_facts_into_one_buffer(picks, deleted, dtype):
    """A request's facts copied out of the user's packed buffer (one copy per run of facts that
    lie back to back): at each address the fact's own bytes, in the request's order, repeats and
    gaps left by deleted facts included; every fact picked once whatever its order fills a buffer
    equal to the user's whole buffer."""
    from inferscale.storage.blocks import copy_rows

    store = PinnedHostStore(PinnedHostStore.Options(device="cpu"))
    facts = make_facts(8, dtype=dtype)
    store.put("alice", facts)
    store.delete("alice", [f"f{i}" for i in deleted])
    kept = [f"f{i}" for i in range(8) if i not in deleted]
    order = [kept[i % len(kept)] for i in picks] if kept else []
    if not order:
        return
    row_of, held = store._users["alice"].held
    copied = copy_rows(held, np.array([row_of[f] for f in order], dtype=np.int64), torch.device("cpu"))
    buffer, = copied.blocks
    assert copied.lengths.tolist() == [facts[f].num_tokens for f in order]
    for fact_id, address, length in zip(order, copied.addresses, copied.lengths):
        at = int(address) - buffer.data_ptr()
        block = store._users["alice"].blocks[fact_id]
        assert torch.equal(buffer[at:at + length * held.layout.token_nbytes()], block.reshape(-1).view(torch.uint8))
    if sorted(set(order), key=kept.index) == kept and len(set(order)) == len(order):
        whole = store._users["alice"].blocks[kept[0]].untyped_storage()
        assert torch.equal(buffer, torch.empty(0, dtype=torch.uint8).set_(whole))
    if len(order) > 1:
        with pytest.raises(ValueError, match="not selected by row"):
            copied.select([0])


def test_copy_rows_declines_blocks_outside_the_first_ones_buffer():
    """Blocks of two buffers (not a pinned store's packing): None, and the caller copies each."""
    from inferscale.storage.blocks import HeldBlocks, copy_rows

    blocks = [torch.randn(2, 3, 4, 2, 8), torch.randn(2, 3, 5, 2, 8)]
    assert copy_rows(HeldBlocks.of(blocks), np.array([0, 1]), torch.device("cpu")) is None
    assert copy_rows(HeldBlocks.of(blocks), np.array([0]), torch.device("cpu")) is not None


def test_get_survives_a_concurrent_repack():
    """A batch taken before a re-pack keeps its values (it never aliases the store)."""
    store = PinnedHostStore(PinnedHostStore.Options(device="cpu"))
    facts = make_facts(3)
    store.put("alice", facts)
    before = store.get("alice", ["f2", "f0"])
    store.put("alice", {"f0": make_fact(1, seed=77)})
    assert_batch(before, facts, ["f2", "f0"])


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_pinned_copies_in_flight_survive_a_repack():
    """The packed buffer a queued get reads from is not reused until its copies ran."""
    store = PinnedHostStore()
    facts = make_facts(6, torch.bfloat16, layers=8, heads=4, size=64)
    store.put("alice", facts)
    torch.cuda._sleep(1_000_000_000)  # keep the stream busy so the copies are still queued
    batch = store.get("alice", list(facts), "cuda")
    store.delete("alice")
    store.put("alice", {f: FactKV(kv.token_ids, kv.keys + 1, kv.values + 1) for f, kv in facts.items()})
    torch.cuda.synchronize()
    assert_batch(batch, facts, list(facts), "cuda")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("at_rest", ["model", "fp8_e4m3"])
def test_pinned_held_rows_on_the_gpu_copy_runs_that_survive_a_repack(at_rest):
    """A request's facts wanted on the GPU: one device buffer whose bytes at each address are the
    fact's, in the request's order (fp8: the dequant where the store keeps it, on the GPU); the
    copies are queued, and a re-pack meanwhile does not reach them."""
    store = PinnedHostStore(kv_dtype_at_rest=at_rest)
    facts = make_facts(8, torch.bfloat16, layers=8, heads=4, size=64)
    store.put("alice", facts)
    order = ["f6", "f1", "f2", "f3", "f7"]
    expected = [store._users["alice"].blocks[f].reshape(-1).view(torch.uint8).clone() for f in order]
    torch.cuda._sleep(1_000_000_000)  # the copies stay queued behind it
    held, rows = store.held_rows("alice", order, "cuda")
    assert rows is None and held.blocks[0].device.type == "cuda" and len(held.blocks) == 1
    dequant = held.dequant_addresses.tolist()
    store.delete("alice")
    store.put("alice", {f: FactKV(kv.token_ids, kv.keys + 1, kv.values + 1) for f, kv in facts.items()})
    torch.cuda.synchronize()
    buffer = held.blocks[0]
    for want, address, length in zip(expected, held.addresses, held.lengths):
        at = int(address) - buffer.data_ptr()
        assert torch.equal(buffer[at:at + len(want)].cpu(), want) and len(want) == length * held.layout.token_nbytes()
    assert held.layout.fp8 == (at_rest == "fp8_e4m3") and (all(dequant) if held.layout.fp8 else not any(dequant))


# -- the memory tier's contract (inferscale.storage.tiers.memory) -------------------------


@pytest.mark.parametrize("name", MEMORY_TIERS)
def test_every_memory_tier_fulfils_the_contract(name, tmp_path):
    tier = make_store(name, tmp_path)
    assert isinstance(tier, MemoryTier) and check_memory_tier(tier) is tier
    assert missing_from_contract(tier) == [] and isinstance(tier.pinned, bool) and tier.volatile


def test_the_disk_tier_is_no_memory_tier(tmp_path):
    with pytest.raises(ConfigError, match=r"kv_store 'disk' \(inferscale.storage.disk.store.DiskStore\) cannot be the "
                                          r"worker's memory tier: it lacks pinned, load, blocks, held_rows"):
        check_memory_tier(make_store("disk", tmp_path))


class NoRows(PinnedHostStore):
    """A third-party tier that forgot part of the contract."""

    name = "no-rows"
    held_rows = None


def test_a_tier_that_lacks_a_method_is_refused_when_the_tiers_are_built(tmp_path):
    plugin = types.SimpleNamespace(register_kv_stores=hookimpl(lambda register: register(NoRows)))
    pm.register(plugin, name="no-rows")
    try:
        config = Config(data_dir=str(tmp_path), kv_store=BackendSpec("no-rows"))
        with pytest.raises(ConfigError, match=r"'no-rows' .* it lacks held_rows \(the contract: "
                                              r"inferscale.storage.tiers.memory.MemoryTier\)"):
            build_tiers(config)
    finally:
        pm.unregister(plugin)
    tiers = build_tiers(Config(data_dir=str(tmp_path), kv_store=BackendSpec("pinned", {"device": "cpu"})))
    assert isinstance(tiers.memory, PinnedHostStore) and tiers.record.root == Config(data_dir=str(tmp_path)).kv_path


# -- selection by name, and tiering ----------------------------------------------------


def test_stores_selected_by_name(tmp_path):
    assert {"hbm", "pinned", "disk"} <= set(backends("kv_store"))
    assert isinstance(build("kv_store", BackendSpec("disk", {"root": str(tmp_path)})), DiskStore)
    assert isinstance(build("kv_store", BackendSpec("pinned")), PinnedHostStore)
    assert isinstance(build("kv_store", BackendSpec("hbm", {"device": "cpu"}), device="cpu"), HBMStore)
    with pytest.raises(ConfigError, match="unknown option"):
        build("kv_store", BackendSpec("disk", {"root": str(tmp_path), "compress": True}))
    with pytest.raises(ConfigError):
        build("kv_store", BackendSpec("disk"))  # root is required
    with pytest.raises(ConfigError):
        build("kv_store", BackendSpec("hbm", {"device": "not-a-device"}))
    with pytest.raises(UnknownBackendError):
        build("kv_store", BackendSpec("tape"))


@pytest.mark.parametrize("memory_name", MEMORY_TIERS)
def test_tiered_loads_user_on_first_use(tmp_path, memory_name):
    disk = DiskStore(DiskStore.Options(root=str(tmp_path)))
    memory = make_store(memory_name, tmp_path)
    facts = make_facts(4, torch.bfloat16)
    disk.put("alice", facts)
    assert ensure_user(memory, disk, "alice") is True
    assert ensure_user(memory, disk, "alice") is False
    assert ensure_user(memory, disk, "nobody") is False and memory.users() == ["alice"]
    assert_batch(memory.get("alice", ["f3", "f1"], "cpu"), facts, ["f3", "f1"])
    assert memory.epoch("alice") == disk.epoch("alice")
    assert ensure_user(disk, disk, "alice") is False  # the disk store needs no loading


@pytest.mark.parametrize("memory_name", MEMORY_TIERS)
def test_stale_memory_is_told_by_epoch_not_by_token_ids(tmp_path, memory_name):
    """Another process re-encodes a fact under the same token ids: the memory tier
    notices (the user's epoch changed) and serves the new K/V."""
    disk = DiskStore(DiskStore.Options(root=str(tmp_path)))
    memory = make_store(memory_name, tmp_path)
    facts = make_facts(3)
    disk.put("alice", facts)
    ensure_user(memory, disk, "alice")
    other = DiskStore(DiskStore.Options(root=str(tmp_path)))  # as another process would
    again = {"f1": FactKV(facts["f1"].token_ids, facts["f1"].keys + 1, facts["f1"].values - 1)}
    other.put("alice", again)
    assert ensure_user(memory, disk, "alice") is True
    assert_batch(memory.get("alice", ["f0", "f1"], "cpu"), {**facts, **again}, ["f0", "f1"])
    other.delete("alice", ["f2"])
    assert ensure_user(memory, disk, "alice") is True and memory.list("alice") == ["f0", "f1"]
    other.delete("alice")  # a user gone from disk leaves the memory tier too
    assert ensure_user(memory, disk, "alice") is False and memory.users() == []


def test_benchmark_script_runs(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "kv_store_get.py"), "--layers", "2", "--facts", "12",
           "--tokens", "4", "--ks", "1,10", "--reps", "2", "--root", str(tmp_path / "root"), "--out", str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    result = json.loads(out.read_text())
    assert {row["store"] for row in result["rows"]} == {"hbm", "pinned", "disk"}


@pytest.mark.parametrize("name", STORES)
def test_epoch_token_ids_are_one_epochs(name, tmp_path):
    """What the scheduler salts a request with: the user's epoch and the facts' token ids,
    together; the errors of token_ids for an unknown user or fact."""
    store = make_store(name, tmp_path)
    facts = make_facts(4)
    store.put("alice", facts)
    epoch, token_ids = store.epoch_token_ids("alice", ["f3", "f1"])
    assert epoch == store.epoch("alice")
    assert token_ids == store.token_ids("alice", ["f3", "f1"]) == [facts["f3"].token_ids, facts["f1"].token_ids]
    with pytest.raises(MissingFactError):
        store.epoch_token_ids("alice", ["f1", "nope"])
    with pytest.raises(UnknownUserError):
        store.epoch_token_ids("bob", ["f1"])
