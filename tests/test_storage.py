"""KV stores: exact round trips, bookkeeping, errors, disk durability and corruption."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferscale.config import BackendSpec, build
from inferscale.errors import (
    ConfigError,
    CorruptDataError,
    MissingFactError,
    ModelMismatchError,
    UnknownBackendError,
    UnknownUserError,
)
from inferscale.kv import FactKV
from inferscale.plugins import backends
from inferscale.storage import DiskStore, HBMStore, KVStore, PinnedHostStore
from inferscale.storage import kvfile
from inferscale.storage.tiered import ensure_user

REPO = Path(__file__).resolve().parents[1]
STORES = ["hbm", "pinned", "disk"]
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
    options = {"root": str(root)} if name == "disk" else {}
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


# -- the disk store ------------------------------------------------------------------


@pytest.fixture
def disk(tmp_path) -> DiskStore:
    return DiskStore(DiskStore.Options(root=str(tmp_path / "kv")))


def read_file(path: Path) -> tuple[dict, dict, int]:
    """(header, metadata, data offset) of a safetensors file, read by hand."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    return header, header["__metadata__"], 8 + size


def test_disk_file_format(disk):
    facts = make_facts(3, torch.bfloat16)
    disk.put("alice", facts)
    path = disk.root / "alice.safetensors"
    header, meta, _ = read_file(path)
    assert meta["format"] == "inferscale-kv" and meta["format_version"] == "2" and meta["user_id"] == "alice"
    assert json.loads(meta["fact_ids"]) == ["f0", "f1", "f2"]
    assert json.loads(meta["layout"]) == {"num_layers": 3, "num_kv_heads": 2, "head_size": 8, "dtype": "bfloat16"}
    assert header["f1/keys"]["dtype"] == "BF16" and header["f1/keys"]["shape"] == [3, 4, 2, 8]
    assert header["f1/token_ids"]["dtype"] == "I64" and header["f1/token_ids"]["shape"] == [4]
    assert meta["sha256"] == checksum_as_documented(path)
    assert sorted(p.name for p in disk.root.iterdir()) == [".lock", "alice.safetensors"]


def checksum_as_documented(path: Path) -> str:
    """docs/storage-format.md's checksum, re-implemented from the raw file (not from kvfile)."""
    import hashlib

    import numpy as np

    header, meta, start = read_file(path)
    raw = path.read_bytes()
    names = {"BF16": "bfloat16", "F32": "float32", "F16": "float16", "I64": "int64"}
    digest = hashlib.sha256()
    for key in sorted(k for k in meta if k != "sha256"):
        digest.update(key.encode() + b"\0" + meta[key].encode() + b"\0")
    for name in sorted(k for k in header if k != "__metadata__"):
        info = header[name]
        shape = ",".join(str(s) for s in info["shape"])
        digest.update(f"{name}\0{names[info['dtype']]}\0{shape}\0".encode())
        lo, hi = info["data_offsets"]
        digest.update(np.frombuffer(raw, dtype=np.uint8, count=hi - lo, offset=start + lo))
    return digest.hexdigest()


def test_load_user_and_two_stores_on_one_root(disk):
    other = DiskStore(DiskStore.Options(root=str(disk.root)))
    facts = make_facts(3, torch.float16)
    disk.put("alice", facts)
    assert other.list("alice") == ["f0", "f1", "f2"]
    loaded = other.load_user("alice")
    assert list(loaded) == list(facts)
    for f, kv in facts.items():
        assert loaded[f].token_ids == kv.token_ids
        assert torch.equal(loaded[f].keys, kv.keys) and torch.equal(loaded[f].values, kv.values)
    other.put("alice", {"f7": make_fact(2, dtype=torch.float16, seed=70)})
    assert disk.list("alice") == ["f0", "f1", "f2", "f7"]  # cache sees the replaced file
    disk.delete("alice", ["f0"])
    assert other.list("alice") == ["f1", "f2", "f7"] and other.token_ids("alice", ["f7"]) == [(70000, 70001)]
    with pytest.raises(UnknownUserError):
        disk.load_user("nobody")


def assert_old_state(root: Path, facts: dict[str, FactKV]) -> None:
    fresh = DiskStore(DiskStore.Options(root=str(root)))
    assert fresh.users() == ["alice"]
    assert_batch(fresh.get("alice", list(facts)), facts, list(facts))


@pytest.mark.parametrize("step", ["replace", "fsync", "write"])
def test_failed_write_keeps_old_state(disk, monkeypatch, step):
    facts = make_facts(3)
    disk.put("alice", facts)

    def fail(*args, **kwargs):
        raise OSError(f"injected {step} failure")

    target = {"replace": (os, "replace"), "fsync": (os, "fsync"), "write": (kvfile, "encode")}[step]
    with monkeypatch.context() as patch:
        patch.setattr(*target, fail)
        with pytest.raises(OSError, match="injected"):
            disk.put("alice", {"f1": make_fact(6, seed=60), "new": make_fact(2, seed=61)})
    assert sorted(p.name for p in disk.root.iterdir()) == [".lock", "alice.safetensors"]
    assert_old_state(disk.root, facts)


CRASH = textwrap.dedent(
    """
    import os, sys, torch
    from inferscale.kv import FactKV
    from inferscale.storage.disk import DiskStore

    def crash(fd):  # the process dies after writing the temp file, before the rename
        os._exit(17)

    os.fsync = crash
    store = DiskStore(DiskStore.Options(root=sys.argv[1]))
    kv = FactKV([1, 2], torch.ones(3, 2, 2, 8), torch.ones(3, 2, 2, 8))
    store.put("alice", {"f0": kv, "crash": kv})
    """
)


def test_process_killed_mid_write(disk):
    facts = make_facts(3)
    disk.put("alice", facts)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", CRASH, str(disk.root)], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 17, proc.stderr.decode()
    temps = [p.name for p in disk.root.glob("*.tmp")]
    assert len(temps) == 1 and temps[0].startswith(".alice.safetensors#")
    assert_old_state(disk.root, facts)
    disk.put("alice", {"f9": make_fact(1, seed=90)})  # the next writer cleans up
    assert list(disk.root.glob("*.tmp")) == []
    assert disk.list("alice") == ["f0", "f1", "f2", "f9"]


def corrupt_payload(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01  # one bit of the last tensor's data
    path.write_bytes(bytes(raw))


def corrupt_dtype(path: Path) -> None:
    raw = path.read_bytes()
    assert b'"BF16"' in raw
    path.write_bytes(raw.replace(b'"BF16"', b'"F16" ', 1))  # still valid JSON, same sizes


def truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 100])


def garbage_header(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[8:40] = b"\xff" * 32
    path.write_bytes(bytes(raw))


def huge_header_length(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[:8] = (2**40).to_bytes(8, "little")
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", [corrupt_payload, corrupt_dtype, truncate, garbage_header, huge_header_length])
def test_corrupt_file_never_returns_kv(disk, damage):
    disk.put("alice", make_facts(3, torch.bfloat16))
    path = disk.root / "alice.safetensors"
    damage(path)
    fresh = DiskStore(DiskStore.Options(root=str(disk.root)))  # no cached index
    for call in (
        lambda: fresh.get("alice", ["f0"]),
        lambda: fresh.load_user("alice"),
        lambda: fresh.list("alice"),
        lambda: fresh.token_ids("alice", ["f0"]),
        lambda: disk.get("alice", ["f1"]),  # the cached index does not bypass verification
        lambda: disk.put("alice", {"f5": make_fact(1, dtype=torch.bfloat16)}),
    ):
        with pytest.raises(CorruptDataError, match="alice.safetensors"):
            call()
    disk.delete("alice")  # a corrupt user can still be removed
    assert disk.users() == []


def test_file_of_another_user_is_corrupt(disk):
    disk.put("alice", make_facts(1))
    (disk.root / "alice.safetensors").rename(disk.root / "bob.safetensors")
    with pytest.raises(CorruptDataError, match="'alice'"):
        disk.get("bob", ["f0"])


def test_unknown_format_version(disk, monkeypatch):
    monkeypatch.setattr(kvfile, "FORMAT_VERSION", "9")
    disk.put("alice", make_facts(1))
    monkeypatch.setattr(kvfile, "FORMAT_VERSION", "2")
    with pytest.raises(CorruptDataError, match="format_version '9'"):
        disk.get("alice", ["f0"])


def test_version_1_files_still_read(disk, monkeypatch):
    """Files written before records and embeddings existed read as K/V with no records."""
    monkeypatch.setattr(kvfile, "FORMAT_VERSION", "1")
    facts = make_facts(2)
    disk.put("alice", facts)
    monkeypatch.undo()
    assert_batch(disk.get("alice", ["f1", "f0"], "cpu"), facts, ["f1", "f0"])
    assert [f.text for f in disk.facts("alice").values()] == ["", ""] and disk.embeddings("alice")[0] == []


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


@pytest.mark.parametrize("memory_name", ["hbm", "pinned"])
def test_tiered_loads_user_on_first_use(tmp_path, memory_name):
    disk = DiskStore(DiskStore.Options(root=str(tmp_path)))
    memory = make_store(memory_name, tmp_path)
    facts = make_facts(4, torch.bfloat16)
    disk.put("alice", facts)
    assert ensure_user(memory, disk, "alice") is True
    assert ensure_user(memory, disk, "alice") is False
    assert ensure_user(memory, disk, "nobody") is False and memory.users() == ["alice"]
    assert_batch(memory.get("alice", ["f3", "f1"], "cpu"), facts, ["f3", "f1"])


def test_benchmark_script_runs(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "kv_store_get.py"), "--layers", "2", "--facts", "12",
           "--tokens", "4", "--ks", "1,10", "--reps", "2", "--root", str(tmp_path / "root"), "--out", str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    result = json.loads(out.read_text())
    assert {row["store"] for row in result["rows"]} == {"hbm", "pinned", "disk"}
