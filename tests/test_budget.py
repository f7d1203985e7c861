"""The memory tier's byte budget: serving many users keeps it bounded, evicting whole
users least recently used first, never the instruction prefix."""

from __future__ import annotations

import pytest
import torch

from inferscale.compose.request import SegmentRequest
from inferscale.compose.rope import RotaryEmbedding
from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER
from inferscale.config import BackendSpec, build
from inferscale.inject.loader import LoadSpec, SegmentLoader, kv_head_range, load_blocks
from inferscale.errors import CapacityError, ConfigError
from inferscale.storage.disk import DiskStore
from inferscale.storage.hbm import HBMStore
from inferscale.storage.pinned import PinnedHostStore
from inferscale.storage.tiers.fill import ensure_user
from test_storage import make_fact, make_facts

FACTS_PER_USER = 4


def user_bytes(disk: DiskStore, user: str, kind: type = PinnedHostStore) -> int:
    """What the user takes of a ``kind`` tier's budget (page-locked, a power of two where CUDA exists)."""
    return kind(kind.Options(device="cpu", max_bytes=0)).footprint(disk.nbytes(user))


@pytest.fixture
def disk(tmp_path) -> DiskStore:
    store = DiskStore(DiskStore.Options(root=str(tmp_path / "kv")))
    store.put(SYSTEM_USER, {PREFIX_FACT: make_fact(5, layers=2, size=8, seed=999)})
    for i in range(40):
        store.put(f"u{i}", make_facts(FACTS_PER_USER, layers=2, size=8))
    return store


def load(loader: SegmentLoader, disk: DiskStore, user: str) -> None:
    """Serve one request for all of the user's facts, as the connector's worker does."""
    request = SegmentRequest(user, tuple(disk.list(user)), 0, None)
    segment = [t for ids in disk.token_ids(SYSTEM_USER, [PREFIX_FACT]) + disk.token_ids(user, request.fact_ids)
               for t in ids]
    epochs = (disk.epoch(SYSTEM_USER), disk.epoch(user))
    spec = LoadSpec("r", request, 0, len(segment), len(segment), load_blocks(range(len(segment)), 1, 0, len(segment)),
                    1, epochs)
    loader.load(spec, num_layers=2, head_size=8)


@pytest.mark.parametrize("kind", [PinnedHostStore, HBMStore])
def test_serving_many_users_stays_within_the_budget(disk, kind):
    per_user = user_bytes(disk, "u0", kind)
    budget = user_bytes(disk, SYSTEM_USER, kind) + 5 * per_user + per_user // 2
    memory = kind(kind.Options(device="cpu", max_bytes=budget))
    rope = RotaryEmbedding(1.0 / (10_000 ** (torch.arange(0, 8, 2).float() / 8)), 8)
    loader = SegmentLoader(memory, disk, rope, kv_head_range(2, 1, 0), "cpu", torch.float32)
    for round_ in range(2):
        for i in range(40):
            load(loader, disk, f"u{i}")
            load(loader, disk, "u0")  # one user stays in use throughout
            assert memory.resident_bytes() <= budget
            assert SYSTEM_USER in memory.users() and "u0" in memory.users()
    assert len(memory.users()) == 6  # the prefix and five users: the most recently used
    assert set(memory.users()) == {SYSTEM_USER, "u0", "u36", "u37", "u38", "u39"}


def test_least_recently_used_users_go_first(disk):
    per_user = user_bytes(disk, "u0")
    memory = PinnedHostStore(PinnedHostStore.Options(device="cpu", max_bytes=3 * per_user))
    for user in ("u0", "u1", "u2"):
        ensure_user(memory, disk, user)
    memory.get("u0", ["f0"])  # a read is a use
    ensure_user(memory, disk, "u3")
    assert sorted(memory.users()) == ["u0", "u2", "u3"]
    assert ensure_user(memory, disk, "u1") is True  # evicted users come back on their next use
    assert sorted(memory.users()) == ["u0", "u1", "u3"]


def test_a_user_larger_than_the_budget_is_refused(disk):
    per_user = user_bytes(disk, "u0")
    memory = PinnedHostStore(PinnedHostStore.Options(device="cpu", max_bytes=user_bytes(disk, SYSTEM_USER) + per_user))
    ensure_user(memory, disk, SYSTEM_USER)
    ensure_user(memory, disk, "u0")
    disk.put("u0", {"big": make_fact(40, layers=2, size=8, seed=7)})
    with pytest.raises(CapacityError, match="max_bytes"):
        ensure_user(memory, disk, "u0")
    assert memory.users() == [SYSTEM_USER]  # the prefix stays; no stale copy of u0 is kept
    with pytest.raises(CapacityError):
        memory.put("u1", {"big": make_fact(40, layers=2, size=8, seed=7)})


def test_budget_is_an_option():
    assert PinnedHostStore().max_bytes == PinnedHostStore.auto_max_bytes()  # "auto": a share of this machine
    store = build("kv_store", BackendSpec("pinned", {"max_bytes": 1 << 20}))
    assert store.max_bytes == 1 << 20
    unbounded = {"device": "cpu", "max_bytes": None, "unbounded": True}
    assert build("kv_store", BackendSpec("hbm", unbounded)).max_bytes is None
    with pytest.raises(ConfigError, match="unbounded = true"):  # no budget only when asked for by name
        build("kv_store", BackendSpec("hbm", {"device": "cpu", "max_bytes": None}))
    for bad in (-1, 1.5, "1GB", True):
        with pytest.raises(ConfigError, match="max_bytes"):
            build("kv_store", BackendSpec("pinned", {"max_bytes": bad}))


class NoUserReads(DiskStore):
    """The disk store, with reading a user's K/V a fault: the budget check must come first."""

    def read_user(self, user_id):
        raise AssertionError(f"{user_id}'s K/V was read before the budget refused them")


def test_a_user_larger_than_the_budget_is_refused_before_it_is_read(disk):
    memory = PinnedHostStore(PinnedHostStore.Options(device="cpu", max_bytes=user_bytes(disk, "u0") - 1))
    with pytest.raises(CapacityError, match="before it was read"):
        ensure_user(memory, NoUserReads(DiskStore.Options(root=str(disk.root))), "u0")
    assert memory.users() == []
