"""The pinned tier's default budget: a quarter of the machine's memory per GPU, read from the
machine (physical memory, a container's cgroup limit, NVML's GPU count) when the store is built;
the HBM tier keeps 4 GiB; ``max_bytes = "auto"`` from a config and the benchmark's ``default``."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from inferscale.config import BackendSpec, Config, build
from inferscale.errors import ConfigError
from inferscale.storage import host_budget, pinned
from inferscale.storage.hbm import HBMStore
from inferscale.storage.host_budget import budget_line, cgroup_memory_limit, host_share, machine_gpus, machine_memory
from inferscale.storage.pinned import PinnedHostStore
from inferscale.storage.resident.store import DEFAULT_MAX_BYTES, ResidentStore
from inferscale.storage.tiers.build import build_tiers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import tier_rows  # noqa: E402

GiB = 1 << 30
TiB = 1 << 40


@pytest.fixture
def machine(monkeypatch):
    """Pretend the machine has ``memory`` bytes and ``gpus`` GPUs."""
    def set_machine(memory: int, gpus: int) -> None:
        monkeypatch.setattr(host_budget, "machine_memory", lambda: memory)
        monkeypatch.setattr(host_budget, "machine_gpus", lambda: gpus)
    return set_machine


@pytest.fixture
def fresh_gpu_count():
    """machine_gpus reads the machine once per process: forget it around a test that changes it."""
    machine_gpus.cache_clear()
    yield
    machine_gpus.cache_clear()


# ---------------------------------------------------------------- the share

@pytest.mark.parametrize("memory, gpus, share", [
    (128 * GiB, 1, 32 * GiB),  # one GPU, 128 GiB
    (2 * TiB, 8, 64 * GiB),  # eight GPUs, 2 TiB: 64 GiB each
    (24 * GiB, 1, 6 * GiB),  # no GPU (counted as one), 24 GiB
    (8 * GiB, 1, 2 * GiB),  # a laptop: a quarter, below 4 GiB
    (64 * GiB, 8, 4 * GiB),  # eight GPUs on 64 GiB: 2 GiB each would be less than the 4 GiB floor
    (0, 1, 0),
])
def test_a_quarter_of_the_memory_per_gpu(memory, gpus, share):
    assert host_share(memory, gpus) == share


def test_no_gpu_counts_as_one():
    assert host_share(24 * GiB, 0) == host_share(24 * GiB, 1) == 6 * GiB


def test_negative_memory_is_refused():
    with pytest.raises(ValueError, match="memory_bytes"):
        host_share(-1, 1)


memories = st.integers(min_value=0, max_value=64 * TiB)
gpu_counts = st.integers(min_value=1, max_value=64)


@given(memories, gpu_counts)
def test_the_share_lies_between_the_floor_and_a_quarter(memory, gpus):
    share = host_share(memory, gpus)
    assert min(DEFAULT_MAX_BYTES, memory // 4) <= share <= memory // 4


@given(memories, memories, gpu_counts)
def test_more_memory_never_lowers_the_share(a, b, gpus):
    low, high = sorted((a, b))
    assert host_share(low, gpus) <= host_share(high, gpus)


@given(memories, gpu_counts, gpu_counts)
def test_more_gpus_never_raise_the_share(memory, a, b):
    few, many = sorted((a, b))
    assert host_share(memory, many) <= host_share(memory, few)


# ---------------------------------------------------------------- reading the machine

@pytest.mark.parametrize("text, limit", [
    ("17179869184\n", 16 * GiB),  # cgroup v2 or v1: a limit
    ("max\n", None),  # cgroup v2: no limit
    ("9223372036854771712\n", None),  # cgroup v1: no limit, written as a huge number
    ("", None),
    ("lots\n", None),
])
def test_a_cgroup_file_gives_its_limit(tmp_path, text, limit):
    path = tmp_path / "memory.max"
    path.write_text(text)
    assert cgroup_memory_limit(path) == limit


def test_a_missing_cgroup_file_means_no_limit(tmp_path):
    assert cgroup_memory_limit(tmp_path / "absent") is None
    assert cgroup_memory_limit(tmp_path) is None  # a directory: unreadable


def test_machine_memory_is_lowered_to_the_cgroup_limit(tmp_path):
    physical = machine_memory(cgroup_files=())
    assert physical > 0
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text("max\n")
    v1.write_text(f"{physical // 2}\n")
    assert machine_memory(cgroup_files=(v2, tmp_path / "absent")) == physical
    assert machine_memory(cgroup_files=(v2, v1)) == physical // 2
    v2.write_text(f"{physical * 2}\n")  # a limit above the physical memory changes nothing
    assert machine_memory(cgroup_files=(v2,)) == physical


def fake_nvml(count: int | None) -> types.ModuleType:
    """A stand-in for ``pynvml``: ``count`` GPUs, or a failing init (no driver) when None."""
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def init():
        if count is None:
            raise NVMLError("Driver Not Loaded")

    module.NVMLError = NVMLError
    module.nvmlInit = init
    module.nvmlDeviceGetCount = lambda: count
    module.nvmlShutdown = lambda: None
    return module


def test_gpus_are_nvml_s_count_of_the_machine(monkeypatch, fresh_gpu_count):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(8))
    monkeypatch.setattr(host_budget.torch.cuda, "device_count", lambda: 1)  # this process sees one of them
    assert machine_gpus() == 8


@pytest.mark.parametrize("nvml", [fake_nvml(None), None])  # no driver; no pynvml at all
def test_without_nvml_gpus_are_those_torch_sees_and_at_least_one(monkeypatch, fresh_gpu_count, nvml):
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # None: `import pynvml` raises ImportError
    monkeypatch.setattr(host_budget.torch.cuda, "device_count", lambda: 2)
    assert machine_gpus() == 2
    machine_gpus.cache_clear()
    monkeypatch.setattr(host_budget.torch.cuda, "device_count", lambda: 0)
    assert machine_gpus() == 1


def test_the_gpu_count_is_read_once(monkeypatch, fresh_gpu_count):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(4))
    assert machine_gpus() == 4
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(2))
    assert machine_gpus() == 4


# ---------------------------------------------------------------- the option

def test_auto_is_the_default_and_the_only_word():
    assert ResidentStore.Options().max_bytes == "auto"
    assert PinnedHostStore.Options(max_bytes="auto").max_bytes == "auto"
    with pytest.raises(ValueError, match="'auto'"):
        PinnedHostStore.Options(max_bytes="lots")
    with pytest.raises(ValueError, match="unbounded"):
        PinnedHostStore.Options(max_bytes=None)
    with pytest.raises(ConfigError, match="max_bytes must be an integer >= 0, 'auto' or None"):
        build("kv_store", BackendSpec("pinned", {"max_bytes": "lots"}))


def test_the_pinned_default_is_the_machine_s_share():
    store = PinnedHostStore()
    assert isinstance(store.max_bytes, int) and not isinstance(store.max_bytes, bool)
    assert store.max_bytes == PinnedHostStore.auto_max_bytes() == host_share(machine_memory(), machine_gpus())
    assert store.max_bytes >= min(DEFAULT_MAX_BYTES, machine_memory() // 4)


def test_the_budget_follows_the_machine_and_is_logged_once(machine, caplog):
    machine(128 * GiB, 1)
    with caplog.at_level(logging.INFO, logger="inferscale.storage.pinned"):
        store = PinnedHostStore(PinnedHostStore.Options(device="cpu"))
    assert store.max_bytes == 32 * GiB
    lines = [r.getMessage() for r in caplog.records if r.name == "inferscale.storage.pinned"]
    assert lines == ["inferscale: pinned tier budget 32.0 GiB (a quarter of 128.0 GiB of memory, 1 GPU)"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="inferscale.storage.pinned"):
        assert PinnedHostStore(PinnedHostStore.Options(device="cpu", max_bytes=1 << 20)).max_bytes == 1 << 20
    assert not caplog.records  # a budget given is not the machine's


def test_the_log_line_says_where_the_budget_comes_from():
    assert budget_line("pinned", 64 * GiB, 2 * TiB, 8) == \
        "pinned tier budget 64.0 GiB (a quarter of 2048.0 GiB of memory split between 8 GPUs)"
    assert budget_line("pinned", 4 * GiB, 64 * GiB, 8) == ("pinned tier budget 4.0 GiB (the least a tier gets; "
                                                          "a quarter of 64.0 GiB of memory split between 8 GPUs "
                                                          "is 2.0 GiB)")


def test_the_hbm_default_stays_4_gib(machine):
    machine(2 * TiB, 1)
    assert HBMStore.auto_max_bytes() == DEFAULT_MAX_BYTES == 4 * GiB
    assert HBMStore(HBMStore.Options(device="cpu")).max_bytes == DEFAULT_MAX_BYTES
    assert build("kv_store", BackendSpec("hbm", {"device": "cpu", "max_bytes": "auto"})).max_bytes == DEFAULT_MAX_BYTES


def test_auto_from_a_toml_config_builds_the_store(tmp_path, machine):
    machine(128 * GiB, 1)
    path = tmp_path / "inferscale.toml"
    path.write_text(f'data_dir = "{tmp_path / "data"}"\n'
                    '[kv_store]\nname = "pinned"\noptions = {device = "cpu", max_bytes = "auto"}\n')
    config = Config.from_toml(path)
    assert config.kv_store == BackendSpec("pinned", {"device": "cpu", "max_bytes": "auto"})
    tiers = build_tiers(config)
    assert tiers.memory.max_bytes == 32 * GiB
    path.write_text('[kv_store]\nname = "pinned"\noptions = {max_bytes = "lots"}\n')
    with pytest.raises(ConfigError, match="max_bytes"):
        build("kv_store", Config.from_toml(path).kv_store)


# ---------------------------------------------------------------- the benchmark's "default"

def test_the_benchmark_s_default_is_the_product_s_budget_for_the_tier():
    assert tier_rows.budget_bytes("default", 1, 1) == PinnedHostStore.auto_max_bytes()
    assert tier_rows.budget_bytes("default", 1, 1, tier="pinned") == PinnedHostStore.auto_max_bytes()
    assert tier_rows.budget_bytes("default", 1, 1, tier="hbm") == DEFAULT_MAX_BYTES
    assert tier_rows.parse_stores("pinned:default,hbm:default") == [("pinned", "default"), ("hbm", "default")]
    with pytest.raises(ValueError, match="pinned or hbm"):
        tier_rows.budget_bytes("default", 1, 1, tier="disk")


# ---------------------------------------------------------------- what the budget counts

@given(st.integers(1, 1 << 45))
def test_a_page_locked_buffer_takes_the_power_of_two_above_it(nbytes):
    taken = pinned.pinned_footprint(nbytes)
    assert taken >= nbytes and taken < 2 * nbytes and taken & (taken - 1) == 0


def test_an_empty_buffer_takes_nothing():
    assert pinned.pinned_footprint(0) == 0


class RoundedUp(PinnedHostStore):
    """A pinned store on the CPU counting what page-locked buffers would take there."""

    def footprint(self, nbytes: int) -> int:
        return pinned.pinned_footprint(nbytes)


def test_the_budget_counts_page_locked_buffers_not_only_the_k_v():
    """Three users of 40 bytes of K/V each fit a budget of 160 bytes as K/V, but take 64 bytes each
    page-locked: the third evicts the first."""
    from test_storage import make_fact

    fact = make_fact(1, layers=1, heads=1, size=5)  # 2 x 1 x 1 x 1 x 5 float32 = 40 bytes
    store = RoundedUp(PinnedHostStore.Options(device="cpu", max_bytes=160))
    for user in ("a", "b", "c"):
        store.put(user, {"f": fact})
    assert store.nbytes("c") == 40
    assert sorted(store.users()) == ["b", "c"]
    plain = PinnedHostStore(PinnedHostStore.Options(device="cpu", max_bytes=160))
    for user in ("a", "b", "c"):
        plain.put(user, {"f": fact})
    assert sorted(plain.users()) == ["a", "b", "c"]  # on the CPU nothing is page-locked: the K/V alone


def test_a_benchmark_user_takes_of_the_budget_what_the_tier_counts():
    expected = pinned.pinned_footprint(40_000_000) if torch.cuda.is_available() else 40_000_000
    assert tier_rows.user_footprint("pinned", 40_000_000) == expected
    assert tier_rows.user_footprint("hbm", 40_000_000) == 40_000_000
