"""Facts kept in fp8 at rest (``Config.kv_dtype_at_rest``): on disk (format 4), in the memory tiers,
converted between forms by writes and loads, and refused when their scales are damaged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save

from inferscale.config import BackendSpec, Config, build
from inferscale.errors import ConfigError, CorruptDataError, ModelMismatchError
from inferscale.kv_fp8 import FP8, FP8_E4M3, MODEL, Fp8KV, all_at_rest, fp8_round_trip, quantize
from inferscale.storage.format import kvfile
from inferscale.storage.disk import DiskStore
from inferscale.storage.layout import KVLayout
from inferscale.storage.tiers.fill import ensure_user
from inferscale.storage.tiers import build_tiers
from test_disk import checksum_as_documented, index_checksum_as_documented, index_of, read_header, segments
from test_storage import MEMORY_TIERS, assert_batch, make_fact, make_facts


@pytest.fixture
def disk(tmp_path) -> DiskStore:
    return DiskStore(DiskStore.Options(root=str(tmp_path / "kv")))


def round_tripped(facts):
    return {f: fp8_round_trip(kv) for f, kv in facts.items()}


def test_a_user_kept_in_fp8_is_format_4_and_says_so(disk):
    facts = make_facts(3, torch.bfloat16)
    disk.put("alice", all_at_rest(facts, FP8_E4M3))
    index = index_of(disk)
    assert index["format_version"] == "4"
    assert index["layout"] == {"num_layers": 3, "num_kv_heads": 2, "head_size": 8, "dtype": "bfloat16",
                               "at_rest": "fp8_e4m3"}
    assert index["sha256"] == index_checksum_as_documented(disk.user_dir("alice") / "index.json")
    (segment,) = segments(disk)
    header, meta, _ = read_header(segment)
    assert meta["format_version"] == "4" and json.loads(meta["layout"])["at_rest"] == "fp8_e4m3"
    assert header["f1/keys"]["dtype"] == "F8_E4M3" and header["f1/keys"]["shape"] == [3, 4, 2, 8]
    assert header["f1/dequant"]["dtype"] == "BF16" and header["f1/dequant"]["shape"] == [2, 3, 2, 9]
    assert meta["sha256"] == checksum_as_documented(segment)
    # read back in the model's dtype, as the round trip gives it; whole users as they are kept
    assert_batch(disk.get("alice", ["f2", "f0"]), round_tripped(facts), ["f2", "f0"])
    _, kept = disk.read_user("alice")
    assert all(isinstance(kv, Fp8KV) for kv in kept.values())
    layout = KVLayout(3, 2, 8, torch.bfloat16, FP8_E4M3)
    assert disk.nbytes("alice") == layout.nbytes(kv.num_tokens for kv in facts.values()) \
        == sum(kv.nbytes for kv in kept.values())


def test_a_write_in_the_other_form_converts_the_user(disk):
    facts = make_facts(4, torch.float16)
    disk.put("alice", dict(list(facts.items())[:2]))
    disk.put("alice", {"f2": facts["f2"]})
    assert len(segments(disk)) >= 1 and index_of(disk)["format_version"] == "3"
    disk.put("alice", {"f3": quantize(facts["f3"])})  # kv_dtype_at_rest changed: every segment rewritten
    (segment,) = segments(disk)
    assert read_header(segment)[1]["format_version"] == "4" and index_of(disk)["format_version"] == "4"
    assert_batch(disk.get("alice", list(facts)), round_tripped(facts), list(facts))
    disk.put("alice", {"f0": facts["f0"]})  # and back: dequantized, f0 anew
    assert index_of(disk)["format_version"] == "3" and len(segments(disk)) == 1
    expected = {**round_tripped(facts), "f0": facts["f0"]}
    assert_batch(disk.get("alice", list(facts)), expected, list(facts))
    with pytest.raises(ModelMismatchError):  # another model is still refused
        disk.put("alice", {"f9": quantize(make_fact(2, size=4, dtype=torch.float16))})


def rewrite_segment(path: Path, edit, **metadata: str) -> None:
    """Apply ``edit(tensors)`` (and ``metadata``) to a segment and write it back with a valid
    checksum, so that only the content checks can catch it."""
    tensors = load_file(path)
    edit(tensors)
    meta = {k: v for k, v in {**read_header(path)[1], **metadata}.items() if k != kvfile.CHECKSUM_KEY}
    meta[kvfile.CHECKSUM_KEY] = kvfile.checksum(meta, tensors)
    path.write_bytes(save(tensors, meta))


def nan_code(tensors):
    tensors["f0/values"].view(torch.uint8)[0, 0, 0, 0] = 0x7F


def scale_not_a_power_of_two(tensors):
    tensors["f1/dequant"][1, 0, 0, -1] *= 1.5


def scale_zero(tensors):
    tensors["f0/dequant"][0, 2, 1, -1] = 0.0


def offset_not_finite(tensors):
    tensors["f0/dequant"][0, 0, 0, 3] = float("nan")


def dequant_missing(tensors):
    del tensors["f1/dequant"]


def dequant_of_another_shape(tensors):
    tensors["f1/dequant"] = tensors["f1/dequant"][:, :, :, :-1].contiguous()


def dequant_relabelled(tensors):
    tensors["f1/dequant"] = tensors["f1/dequant"].float()


def codes_relabelled(tensors):  # the same bytes read as int8
    tensors["f0/keys"] = tensors["f0/keys"].view(torch.int8)


@pytest.mark.parametrize("damage", [nan_code, scale_not_a_power_of_two, scale_zero, offset_not_finite, dequant_missing,
                                    dequant_of_another_shape, dequant_relabelled, codes_relabelled])
def test_damaged_scales_never_reach_a_reader(disk, damage):
    """A segment whose checksum matches its (damaged) contents: the read still refuses it, whole."""
    disk.put("alice", all_at_rest(make_facts(2, torch.bfloat16), FP8_E4M3))
    (segment,) = segments(disk)
    rewrite_segment(segment, damage)
    for read in (lambda: disk.get("alice", ["f0"]), lambda: disk.read_user("alice")):
        with pytest.raises(CorruptDataError):
            read()


@pytest.mark.parametrize("form, version", [(FP8_E4M3, "3"), (MODEL, "4")])
def test_a_version_that_contradicts_the_layout_is_corrupt(disk, form, version):
    """Format 4 is fp8's, and fp8 is format 4's (each with a checksum that matches)."""
    disk.put("alice", all_at_rest(make_facts(1), form))
    (segment,) = segments(disk)
    rewrite_segment(segment, lambda tensors: None, format_version=version)
    with pytest.raises(CorruptDataError, match="format_version"):
        disk.get("alice", ["f0"])


@pytest.mark.parametrize("name", MEMORY_TIERS)
def test_a_memory_tier_keeps_its_form_whatever_it_is_given(name, tmp_path):
    """A tier kept in fp8 holds e4m3 blocks with each fact's dequant (page-locked where the blocks
    are), half the bytes, and reads back what the round trip gives; facts added, loaded and deleted
    keep each block beside its own dequant."""
    options = {"mmap": {"directory": str(tmp_path / "mapped")}}.get(name, {})
    tier = build("kv_store", BackendSpec(name, options), kv_dtype_at_rest=FP8_E4M3, device="cpu")
    facts = make_facts(5, torch.bfloat16)
    tier.load("alice", dict(list(facts.items())[:3]), "e1")  # in the model's dtype: quantized
    tier.put("alice", {"f3": facts["f3"], "f4": quantize(facts["f4"])})
    tier.delete("alice", ["f1"])
    kept = [f for f in facts if f != "f1"]
    assert_batch(tier.get("alice", kept[::-1]), round_tripped(facts), kept[::-1])
    layout = KVLayout(3, 2, 8, torch.bfloat16, FP8_E4M3)
    assert tier.nbytes("alice") == layout.nbytes(facts[f].num_tokens for f in kept)
    held, rows = tier.held_rows("alice", ["f4", "f0"], "cpu")
    assert held.layout == layout and all(b.dtype == FP8 for b in held.blocks)
    assert held.dequant_addresses.tolist() == [d.data_ptr() for d in held.dequant]
    for row, fact_id in zip(rows, ["f4", "f0"]):
        expected = quantize(facts[fact_id])
        assert torch.equal(held.blocks[row][0].view(torch.uint8), expected.keys.view(torch.uint8))
        assert torch.equal(held.dequant[row], expected.dequant)
    plain = build("kv_store", BackendSpec(name, options), device="cpu")  # the model's dtype: fp8 facts dequantized
    plain.load("alice", all_at_rest(facts, FP8_E4M3), "e1")
    assert_batch(plain.get("alice", list(facts)), round_tripped(facts), list(facts))
    assert plain.held_rows("alice", ["f0"], "cpu")[0].layout == layout.kept_as(MODEL)


def test_the_memory_tier_follows_the_config_and_not_the_disk(tmp_path):
    """A user kept in the model's dtype on disk is held in fp8 by a tier set to it, and the
    other way round: one form in memory, whatever each user's files hold."""
    config = Config(data_dir=str(tmp_path), kv_dtype_at_rest="fp8_e4m3")
    tiers = build_tiers(config)
    assert tiers.memory.kv_dtype_at_rest == FP8_E4M3
    facts = make_facts(3, torch.bfloat16)
    tiers.record.put("plain", facts)
    tiers.record.put("small", all_at_rest(facts, FP8_E4M3))
    for user in ("plain", "small"):
        assert ensure_user(tiers.memory, tiers.record, user)
        assert tiers.memory.held_rows(user, ["f0"], "cpu")[0].layout.fp8
        assert_batch(tiers.memory.get(user, list(facts)), round_tripped(facts), list(facts))
    plain = build_tiers(Config(data_dir=str(tmp_path)))
    assert ensure_user(plain.memory, plain.record, "small")
    assert not plain.memory.held_rows("small", ["f0"], "cpu")[0].layout.fp8


def test_the_setting_is_checked():
    with pytest.raises(ConfigError, match="kv_dtype_at_rest"):
        Config(kv_dtype_at_rest="fp8")
    assert Config.from_dict({"kv_dtype_at_rest": "fp8_e4m3"}).kv_dtype_at_rest == "fp8_e4m3"
    assert Config().kv_dtype_at_rest == "model"


def test_bytes_halve_on_a_realistic_fact():
    """A fact of 35 tokens of Qwen2.5-7B's shape (28 layers, 4 KV heads of 128) in bf16 and in fp8."""
    layout = KVLayout(28, 4, 128, torch.bfloat16)
    fp8 = layout.kept_as(FP8_E4M3)
    assert fp8.nbytes([35]) / layout.nbytes([35]) == pytest.approx((35 + 2 + 2 / 128) / 70)
    assert np.isclose(fp8.token_nbytes() * 2, layout.token_nbytes())


@pytest.mark.parametrize("form, version", [(FP8_E4M3, "3"), (MODEL, "4")])
def test_an_index_whose_version_contradicts_its_layout_is_corrupt(disk, form, version):
    from inferscale.storage.format.index import canonical, checksum

    disk.put("alice", all_at_rest(make_facts(1), form))
    path = disk.user_dir("alice") / "index.json"
    body = json.loads(path.read_bytes())
    del body["sha256"]
    body["format_version"] = version
    path.write_bytes(canonical({**body, "sha256": checksum(body)}))
    with pytest.raises(CorruptDataError, match="format_version"):
        DiskStore(DiskStore.Options(root=str(disk.root))).list("alice")


def test_the_memory_side_writes_in_the_configured_form(tiny_model_dirs, tmp_path):
    """With kv_dtype_at_rest = "fp8_e4m3" the memory side stores new facts and the instruction prefix
    in fp8; the same facts added with the default are what fp8 rounds."""
    from inferscale.api import Context, MemoryAPI
    from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER

    model = str(tiny_model_dirs["qwen2"])
    facts = ["Ann has a cat named Miso.", "Ann runs on Sundays."]
    stored = {}
    for form in (MODEL, FP8_E4M3):
        memory = MemoryAPI(Context(Config.from_dict({"model": model, "data_dir": str(tmp_path / form),
                                                     "kv_dtype_at_rest": form})))
        memory.add_facts("ann", facts, progress=False)
        disk = memory.context.record
        assert isinstance(disk.load_user(SYSTEM_USER)[PREFIX_FACT], Fp8KV) == (form == FP8_E4M3)
        stored[form] = {f.text: disk.load_user("ann")[f.fact_id] for f in memory.list_facts("ann")}
        memory.close()
    for text in facts:
        assert isinstance(stored[FP8_E4M3][text], Fp8KV)
        assert torch.equal(quantize(stored[MODEL][text]).keys.view(torch.uint8),
                           stored[FP8_E4M3][text].keys.view(torch.uint8))
