"""The disk store: format 3 on disk, appends and compaction, crash safety, corruption,
and files of formats 1 and 2."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from inferscale.errors import CorruptDataError, UnknownUserError
from inferscale.facts import Fact
from inferscale.kv import FactKV
from inferscale.storage.format import index as index_format
from inferscale.storage.format import kvfile
from inferscale.storage.disk import DiskStore
from test_storage import assert_batch, make_fact, make_facts

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def disk(tmp_path) -> DiskStore:
    return DiskStore(DiskStore.Options(root=str(tmp_path / "kv")))


def fresh(disk: DiskStore) -> DiskStore:
    """Another store on the same root, with nothing cached (as another process)."""
    return DiskStore(DiskStore.Options(root=str(disk.root)))


def segments(disk: DiskStore, user: str = "alice") -> list[Path]:
    return sorted(disk.user_dir(user).glob("seg-*.safetensors"))


def index_of(disk: DiskStore, user: str = "alice") -> dict:
    return json.loads((disk.user_dir(user) / "index.json").read_bytes())


def read_header(path: Path) -> tuple[dict, dict, int]:
    """(header, metadata, data offset) of a safetensors file, read by hand."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    return header, header["__metadata__"], 8 + size


def leftovers(disk: DiskStore, user: str = "alice") -> list[str]:
    """Files of the user that the index does not account for."""
    listed = {s["name"] for s in index_of(disk, user)["segments"]} | {"index.json"}
    return sorted(p.name for p in disk.user_dir(user).iterdir() if p.name not in listed)


# -- format 3 on disk ---------------------------------------------------------------


def test_format_3_layout(disk):
    facts = make_facts(3, torch.bfloat16)
    disk.put("alice", facts, {"f0": Fact("f0", "alice", "Alice has a cat.", "D1:2")},
             {"f0": torch.ones(4), "f1": torch.zeros(4)})
    assert sorted(p.name for p in disk.root.iterdir()) == [".lock", "users"]
    (segment,) = segments(disk)
    assert sorted(p.name for p in disk.user_dir("alice").iterdir()) == ["index.json", segment.name]
    index = index_of(disk)
    assert (index["format"], index["format_version"], index["user_id"]) == ("inferscale-kv-index", "3", "alice")
    assert re.fullmatch("[0-9a-f]{32}", index["generation"]) and index["generation"] == disk.epoch("alice")
    assert index["layout"] == {"num_layers": 3, "num_kv_heads": 2, "head_size": 8, "dtype": "bfloat16"}
    assert index["facts"] == [
        {"id": "f0", "segment": segment.name, "token_ids": list(facts["f0"].token_ids), "text": "Alice has a cat.",
         "source_turn": "D1:2"},
        {"id": "f1", "segment": segment.name, "token_ids": list(facts["f1"].token_ids)},
        {"id": "f2", "segment": segment.name, "token_ids": list(facts["f2"].token_ids)},
    ]
    assert index["sha256"] == index_checksum_as_documented(disk.user_dir("alice") / "index.json")
    header, meta, _ = read_header(segment)
    assert (meta["format"], meta["format_version"], meta["user_id"]) == ("inferscale-kv", "3", "alice")
    assert json.loads(meta["fact_ids"]) == ["f0", "f1", "f2"]
    assert header["f1/keys"]["dtype"] == "BF16" and header["f1/keys"]["shape"] == [3, 4, 2, 8]
    assert header["f0/embedding"]["shape"] == [4] and "f2/embedding" not in header
    assert meta["sha256"] == checksum_as_documented(segment)
    assert index["segments"] == [{"name": segment.name, "sha256": meta["sha256"], "bytes": segment.stat().st_size}]


def index_checksum_as_documented(path: Path) -> str:
    """docs/storage-format.md's index checksum, re-implemented (not from index.py)."""
    body = json.loads(path.read_bytes())
    del body["sha256"]
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def checksum_as_documented(path: Path) -> str:
    """docs/storage-format.md's K/V file checksum, re-implemented from the raw file (not from kvfile)."""
    header, meta, start = read_header(path)
    raw = path.read_bytes()
    names = {"BF16": "bfloat16", "F32": "float32", "F16": "float16", "I64": "int64", "F8_E4M3": "float8_e4m3fn"}
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


def test_two_stores_on_one_root(disk):
    other = fresh(disk)
    facts = make_facts(3, torch.float16)
    disk.put("alice", facts)
    assert other.list("alice") == ["f0", "f1", "f2"]
    loaded = other.load_user("alice")
    assert list(loaded) == list(facts)
    for f, kv in facts.items():
        assert loaded[f].token_ids == kv.token_ids
        assert torch.equal(loaded[f].keys, kv.keys) and torch.equal(loaded[f].values, kv.values)
    other.put("alice", {"f7": make_fact(2, dtype=torch.float16, seed=70)})
    assert disk.list("alice") == ["f0", "f1", "f2", "f7"]  # the cached index sees the new one
    disk.delete("alice", ["f0"])
    assert other.list("alice") == ["f1", "f2", "f7"] and other.token_ids("alice", ["f7"]) == [(70000, 70001)]
    assert other.epoch("alice") == disk.epoch("alice")
    with pytest.raises(UnknownUserError):
        disk.load_user("nobody")


# -- appends and compaction ----------------------------------------------------------------


def test_adding_facts_appends_without_rewriting(disk):
    facts = make_facts(20)
    disk.put("alice", facts)
    (first,) = segments(disk)
    before = (first.stat().st_ino, first.stat().st_mtime_ns, first.read_bytes())
    added = {"new": make_fact(2, seed=99)}
    disk.put("alice", added)
    assert (first.stat().st_ino, first.stat().st_mtime_ns, first.read_bytes()) == before
    assert len(segments(disk)) == 2
    every = {**facts, **added}
    assert fresh(disk).list("alice") == list(every)
    assert_batch(fresh(disk).get("alice", list(every)), every, list(every))


def test_segments_stay_few_however_facts_arrive(disk):
    """64 single-fact writes leave at most log2(64) + 1 segments, each older one larger."""
    facts = {f"g{i}": make_fact(3, seed=i) for i in range(64)}
    for fact_id, kv in facts.items():
        disk.put("alice", {fact_id: kv})
    sizes = [s["bytes"] for s in index_of(disk)["segments"]]
    assert len(sizes) <= 7 and sizes == sorted(sizes, reverse=True)
    assert leftovers(disk) == []
    assert fresh(disk).list("alice") == list(facts)
    assert_batch(fresh(disk).get("alice", list(facts)), facts, list(facts))


def test_deleted_and_replaced_facts_leave_the_disk(disk):
    facts = make_facts(6)
    disk.put("alice", dict(list(facts.items())[:3]))
    disk.put("alice", dict(list(facts.items())[3:]))
    replaced = facts["f4"]
    disk.put("alice", {"f4": make_fact(5, seed=44)})
    disk.delete("alice", ["f1"])
    disk.put("alice", {"g2": make_fact(3, seed=72)}, drop=["f2"])  # replaced under another id, in one write
    stored = b"".join(p.read_bytes() for p in disk.user_dir("alice").iterdir())
    for gone in (facts["f1"].keys, replaced.keys, facts["f2"].keys):
        assert gone.numpy().tobytes() not in stored
    assert b"f1/keys" not in stored and b"f2/keys" not in stored and leftovers(disk) == []
    assert fresh(disk).list("alice") == ["f0", "f3", "f4", "f5", "g2"]


def test_index_reads_never_touch_the_kv(disk):
    """What the scheduler reads (token ids, ids, records, sizes, epoch) comes from the
    index alone: with every K/V file gone it still reads, and K/V reads refuse."""
    facts = make_facts(4)
    disk.put("alice", facts, {"f2": Fact("f2", "alice", "Alice rows.")})
    epoch = disk.epoch("alice")
    for path in segments(disk):
        path.unlink()
    store = fresh(disk)
    assert store.list("alice") == list(facts) and store.epoch("alice") == epoch
    assert store.token_ids("alice", ["f3", "f0"]) == [facts["f3"].token_ids, facts["f0"].token_ids]
    assert store.facts("alice")["f2"].text == "Alice rows." and store.nbytes("alice") == sum(
        kv.nbytes for kv in facts.values())
    for read in (lambda: store.get("alice", ["f0"]), lambda: store.load_user("alice")):
        with pytest.raises(CorruptDataError, match="missing"):
            read()


# -- crash safety ----------------------------------------------------------------------------


def assert_state(root: Path, facts: dict[str, FactKV]) -> None:
    store = DiskStore(DiskStore.Options(root=str(root)))
    assert store.users() == ["alice"] and store.list("alice") == list(facts)
    assert_batch(store.get("alice", list(facts)), facts, list(facts))


@pytest.mark.parametrize("step", ["segment rename", "fsync", "encode", "index rename"])
def test_failed_write_keeps_old_state(disk, monkeypatch, step):
    facts = make_facts(3)
    disk.put("alice", facts)
    real_replace = os.replace

    def fail(*args, **kwargs):
        raise OSError(f"injected {step} failure")

    def fail_index(src, dst, *args, **kwargs):
        if str(dst).endswith("index.json"):
            fail()
        return real_replace(src, dst, *args, **kwargs)

    target = {"segment rename": (os, "replace", fail), "fsync": (os, "fsync", fail),
              "encode": (kvfile, "encode", fail), "index rename": (os, "replace", fail_index)}[step]
    with monkeypatch.context() as patch:
        patch.setattr(*target)
        with pytest.raises(OSError, match="injected"):
            disk.put("alice", {"f1": make_fact(6, seed=60), "new": make_fact(2, seed=61)})
    assert_state(disk.root, facts)
    assert not list(disk.root.rglob("*.tmp"))
    disk.put("alice", {"f9": make_fact(1, seed=90)})  # the next writer removes what the failure left
    assert leftovers(disk) == [] and fresh(disk).list("alice") == ["f0", "f1", "f2", "f9"]


CRASH = textwrap.dedent(
    """
    import os, sys, torch
    from inferscale.kv import FactKV
    from inferscale.storage.disk import DiskStore

    calls, crash_at, real = [0], int(sys.argv[2]), os.fsync

    def fsync(fd):  # the process dies at the crash_at-th fsync of the write
        calls[0] += 1
        if calls[0] == crash_at:
            os._exit(17)
        real(fd)

    store = DiskStore(DiskStore.Options(root=sys.argv[1]))
    kv = FactKV([1, 2], torch.ones(3, 2, 2, 8), torch.ones(3, 2, 2, 8))
    os.fsync = fsync
    store.put(sys.argv[3] if len(sys.argv) > 3 else "alice", {"crash": kv})
    """
)


#: an append's fsyncs: 1 the segment's temp file, 2 its directory entry, 3 the index's temp file,
#: 4 the index's rename (the commit), 5 the directory after the write
@pytest.mark.parametrize("crash_at, committed", [(1, False), (3, False), (5, True)])
def test_process_killed_mid_write(disk, crash_at, committed):
    facts = make_facts(3)
    disk.put("alice", facts)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", CRASH, str(disk.root), str(crash_at)], env=env,
                          capture_output=True, timeout=120)
    assert proc.returncode == 17, proc.stderr.decode()
    kv = FactKV([1, 2], torch.ones(3, 2, 2, 8), torch.ones(3, 2, 2, 8))
    assert_state(disk.root, {**facts, "crash": kv} if committed else facts)
    disk.put("alice", {"f9": make_fact(1, seed=90)})  # the next writer cleans up
    assert not list(disk.root.rglob("*.tmp")) and leftovers(disk) == []
    assert fresh(disk).list("alice")[-1] == "f9"


@pytest.mark.parametrize("crash_at", [1, 3])
def test_sweep_removes_what_crashed_writes_left_without_a_write(disk, crash_at):
    """A server sweeps once as it starts: users no one writes to again are cleaned too, and a
    first write that never committed leaves no directory behind."""
    facts = make_facts(3)
    disk.put("alice", facts)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for user in ("alice", "bob"):  # bob: a new user whose first write never committed
        proc = subprocess.run([sys.executable, "-c", CRASH, str(disk.root), str(crash_at), user], env=env,
                              capture_output=True, timeout=120)
        assert proc.returncode == 17, proc.stderr.decode()
    assert leftovers(disk) and disk.user_dir("bob").is_dir()
    corrupt = disk.user_dir("carol")
    disk.put("carol", make_facts(1))
    (corrupt / "index.json").write_bytes(b"{}")
    stray = disk.root / "users" / "not a user"
    stray.mkdir()
    assert fresh(disk).sweep() == ["alice", "bob"]
    assert leftovers(disk) == [] and not disk.user_dir("bob").exists() and not list(disk.root.rglob("*.tmp"))
    assert fresh(disk).users() == ["alice", "carol"]
    assert_batch(fresh(disk).get("alice", list(facts)), facts, list(facts))
    assert (corrupt / "index.json").read_bytes() == b"{}" and stray.is_dir()  # left alone
    assert fresh(disk).sweep() == []


# -- corruption --------------------------------------------------------------------------------


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


def swap_for_another_segment(path: Path) -> None:
    """A valid segment of the same user, but not the one the index recorded."""
    other = DiskStore(DiskStore.Options(root=str(path.parents[3] / "other")))
    same_tokens = {f: FactKV(kv.token_ids, kv.keys + 1, kv.values) for f, kv in make_facts(3, torch.bfloat16).items()}
    other.put("alice", same_tokens)
    (replacement,) = other.user_dir("alice").glob("seg-*.safetensors")
    path.write_bytes(replacement.read_bytes())


@pytest.mark.parametrize("damage", [corrupt_payload, corrupt_dtype, truncate, garbage_header, huge_header_length,
                                    swap_for_another_segment])
def test_corrupt_segment_never_returns_kv(disk, damage):
    facts = make_facts(3, torch.bfloat16)
    disk.put("alice", facts)
    (path,) = segments(disk)
    damage(path)
    store = fresh(disk)
    for call in (lambda: store.get("alice", ["f0"]), lambda: store.load_user("alice"),
                 lambda: disk.get("alice", ["f1"]), lambda: disk.delete("alice", ["f0"])):
        with pytest.raises(CorruptDataError, match=path.name):
            call()
    assert store.token_ids("alice", ["f2"]) == [facts["f2"].token_ids]  # the index is intact
    disk.delete("alice")  # a corrupt user can still be removed
    assert disk.users() == [] and not disk.user_dir("alice").exists()


def edit_index(path: Path) -> None:
    path.write_bytes(path.read_bytes().replace(b'"token_ids":[1000', b'"token_ids":[1001'))


@pytest.mark.parametrize("damage", [edit_index, truncate, garbage_header])
def test_corrupt_index_is_refused(disk, damage):
    disk.put("alice", make_facts(3))
    path = disk.user_dir("alice") / "index.json"
    damage(path)
    store = fresh(disk)
    for call in (lambda: store.list("alice"), lambda: store.token_ids("alice", ["f0"]),
                 lambda: store.epoch("alice"), lambda: store.get("alice", ["f0"]),
                 lambda: disk.put("alice", {"f5": make_fact(1)})):
        with pytest.raises(CorruptDataError, match="index.json"):
            call()
    disk.delete("alice")
    assert disk.users() == []


@pytest.mark.parametrize("bad", [-1, 2**63])
def test_token_ids_outside_the_vocabulary_range_are_refused(disk, bad):
    """Token ids are int64 vocabulary indices (cache salts hash them as such): a fact with another
    id is refused on write, and an index naming one — checksum and all — is corrupt on read."""
    good = make_fact(2)
    with pytest.raises(ValueError, match="token ids"):
        FactKV([bad, 5], good.keys, good.values)
    disk.put("alice", {"f0": good})
    path = disk.user_dir("alice") / "index.json"
    index = index_format.UserIndex.decode(path.read_bytes(), "alice", str(path))
    entry = index.facts["f0"]
    forged = index_format.UserIndex(index.user_id, index.epoch, index.layout,
                                    {"f0": index_format.FactEntry(entry.segment, (bad, *entry.token_ids[1:]), entry.record)},
                                    index.segments)
    path.write_bytes(forged.encode())
    with pytest.raises(CorruptDataError, match="0..2\\*\\*63-1"):
        fresh(disk).token_ids("alice", ["f0"])


def test_index_of_another_user_is_corrupt(disk):
    disk.put("alice", make_facts(1))
    disk.user_dir("alice").rename(disk.user_dir("bob"))
    with pytest.raises(CorruptDataError, match="'alice'"):
        disk.get("bob", ["f0"])


def test_unknown_format_versions(disk, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(kvfile, "FORMAT_VERSION", "9")
        disk.put("alice", make_facts(1))
    with pytest.raises(CorruptDataError, match="format_version '9'"):
        disk.get("alice", ["f0"])
    with monkeypatch.context() as patch:
        patch.setattr(index_format, "VERSION", "9")
        disk.put("bob", make_facts(1))
    with pytest.raises(CorruptDataError, match="format_version '9'"):
        fresh(disk).list("bob")


@pytest.mark.parametrize("user", [".", ".."])
def test_ids_that_are_not_names_are_refused(disk, user):
    with pytest.raises(ValueError):
        disk.put(user, make_facts(1))
    with pytest.raises(ValueError):
        disk.list(user)


# -- formats 1 and 2 -------------------------------------------------------------------------


def write_legacy(root: Path, user: str, facts: dict[str, FactKV], version: str, records: dict | None = None,
                 embeddings: dict | None = None) -> Path:
    """A file as formats 1 and 2 were written (docs/storage-format.md): one per user."""
    tensors = {}
    for fact_id, kv in facts.items():
        tensors[f"{fact_id}/keys"] = kv.keys.clone()
        tensors[f"{fact_id}/values"] = kv.values.clone()
        tensors[f"{fact_id}/token_ids"] = torch.tensor(kv.token_ids, dtype=torch.int64)
    for fact_id, vector in (embeddings or {}).items():
        tensors[f"{fact_id}/embedding"] = vector.clone()
    kv = next(iter(facts.values()))
    layout = {"num_layers": kv.keys.shape[0], "num_kv_heads": kv.keys.shape[2], "head_size": kv.keys.shape[3],
              "dtype": str(kv.keys.dtype).removeprefix("torch.")}
    metadata = {"format": "inferscale-kv", "format_version": version, "user_id": user,
                "layout": json.dumps(layout, sort_keys=True), "fact_ids": json.dumps(list(facts))}
    if version == "2":
        metadata["records"] = json.dumps(records or {}, sort_keys=True)
    metadata["sha256"] = kvfile.checksum(metadata, tensors)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{user}.safetensors"
    save_file(tensors, str(path), metadata)
    return path


RECORD = {"f1": {"text": "Alice has a cat.", "source_turn": "D1:2"}}


@pytest.mark.parametrize("version", ["1", "2"])
def test_format_1_and_2_files_are_read(disk, version):
    facts = make_facts(3)
    write_legacy(disk.root, "alice", facts, version, RECORD, {"f1": torch.ones(3)})
    store = fresh(disk)
    assert store.users() == ["alice"] and store.list("alice") == list(facts)
    assert_batch(store.get("alice", ["f2", "f0"]), facts, ["f2", "f0"])
    assert store.token_ids("alice", ["f1"]) == [facts["f1"].token_ids] and store.epoch("alice")
    assert store.facts("alice")["f1"].text == ("Alice has a cat." if version == "2" else "")
    assert store.embeddings("alice")[0] == ["f1"]


def test_format_2_token_ids_are_read_without_the_kv(disk):
    """The planner reads a format 2 file's token ids from its header; the damaged K/V
    is caught by the read that returns it."""
    facts = make_facts(3)
    corrupt_payload(write_legacy(disk.root, "alice", facts, "2"))
    store = fresh(disk)
    assert store.token_ids("alice", ["f0", "f2"]) == [facts["f0"].token_ids, facts["f2"].token_ids]
    with pytest.raises(CorruptDataError, match="checksum"):
        store.get("alice", ["f0"])


@pytest.mark.parametrize("change", ["put", "delete fact"])
def test_first_write_converts_to_format_3(disk, change):
    facts = make_facts(3)
    legacy = write_legacy(disk.root, "alice", facts, "2", RECORD, {"f1": torch.ones(3)})
    before = fresh(disk).epoch("alice")
    if change == "put":
        added = {"f9": make_fact(2, seed=90)}
        disk.put("alice", added)
        expected = {**facts, **added}
    else:
        disk.delete("alice", ["f0"])
        expected = {f: facts[f] for f in ("f1", "f2")}
    assert not legacy.exists() and index_of(disk)["format_version"] == "3"
    store = fresh(disk)
    assert store.list("alice") == list(expected) and store.epoch("alice") != before
    assert_batch(store.get("alice", list(expected)), expected, list(expected))
    assert store.facts("alice")["f1"].text == "Alice has a cat." and store.embeddings("alice")[0] == ["f1"]
    # a crash right after the conversion leaves the old file behind: the index wins, the next write removes it
    write_legacy(disk.root, "alice", facts, "2")
    assert fresh(disk).list("alice") == list(expected)
    disk.put("alice", {"f8": make_fact(1, seed=80)})
    assert not legacy.exists()


def test_deleting_a_format_2_user_removes_the_file(disk):
    legacy = write_legacy(disk.root, "alice", make_facts(2), "2")
    disk.delete("alice")
    assert not legacy.exists() and disk.users() == [] and disk.epoch("alice") is None


def test_benchmark_script_runs(tmp_path):
    """benchmarks/disk_store.py, tiny, against the commit before format 3 (from git)."""
    import shutil

    if shutil.which("git") is None or subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", "2de794e"],
                                                     capture_output=True).returncode:
        pytest.skip("needs the git history (the 'before' side is git archive of a commit)")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "disk_store.py"), "--plan-facts", "12", "--plan-tokens", "6",
           "--plan-shape", "qwen2.5-0.5b", "--add-facts", "30", "--add-tokens", "4", "--reps", "2",
           "--root", str(tmp_path / "work"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr.decode()
    result = json.loads(out.read_text())
    assert set(result["sides"]) == {"before", "after"} and set(result["ratios"]) == {"plan", "add"}
    assert "planner, cold user" in proc.stdout.decode()
