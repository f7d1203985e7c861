import os

import pytest
import torch

pytest.importorskip("inferscale_mmap", reason="pip install ./plugins/inferscale-mmap")

from inferscale import BackendSpec, Config, ConfigError, build  # noqa: E402
from inferscale.kv import FactKV  # noqa: E402
from inferscale.storage.tiers import build_tiers  # noqa: E402


def fact(tokens: int, seed: int) -> FactKV:
    gen = torch.Generator().manual_seed(seed)
    return FactKV(tuple(range(tokens)), torch.randn(2, tokens, 2, 8, generator=gen),
                  torch.randn(2, tokens, 2, 8, generator=gen))


def test_selectable_by_name_through_the_entry_point(tmp_path):
    spec = BackendSpec("mmap", {"directory": str(tmp_path / "mapped")})
    tiers = build_tiers(Config(data_dir=str(tmp_path), kv_store=spec))
    assert type(tiers.memory).__module__ == "inferscale_mmap.store" and tiers.memory.pinned is False


def test_each_user_is_one_mapped_file_that_leaves_nothing_behind(tmp_path):
    store = build("kv_store", BackendSpec("mmap", {"directory": str(tmp_path), "max_bytes": 1 << 20}))
    facts = {"a": fact(3, 1), "b": fact(5, 2)}
    store.put("ann", facts)
    blocks = store.blocks("ann", ["b", "a"], "cpu")
    assert len({block.untyped_storage().data_ptr() for block in blocks}) == 1  # one buffer per user
    assert torch.equal(blocks[0][0], facts["b"].keys) and torch.equal(blocks[1][1], facts["a"].values)
    assert os.listdir(tmp_path) == []  # mapped, then unlinked
    with open("/proc/self/maps") as maps:
        assert str(tmp_path) in maps.read()  # the buffer is a mapping of a file there


def test_bad_directory_is_a_config_error():
    with pytest.raises(ConfigError, match="directory"):
        build("kv_store", BackendSpec("mmap", {"directory": ""}))
