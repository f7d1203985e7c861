"""A small disk store for the planner's tests: the instruction prefix (4 tokens) and user ``ann``'s
facts ``a``, ``b``, ``c`` (6, 5 and 3 tokens) of random K/V, 2 layers x 2 KV heads x 8."""

from __future__ import annotations

from pathlib import Path

import torch

from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER
from inferscale.kv import FactKV
from inferscale.storage.disk import DiskStore


def random_fact(n: int, seed: int, layers: int = 2, heads: int = 2, dim: int = 8) -> FactKV:
    """``n`` tokens of random ids and K/V, the same for the same ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 1000, (n,), generator=gen).tolist()
    kv = torch.randn((2, layers, n, heads, dim), generator=gen)
    return FactKV(ids, kv[0], kv[1])


def ann_store(root: Path) -> DiskStore:
    """The store described above, under ``root``."""
    store = DiskStore(DiskStore.Options(root=str(root)))
    store.put(SYSTEM_USER, {PREFIX_FACT: random_fact(4, 0)})
    store.put("ann", {"a": random_fact(6, 1), "b": random_fact(5, 2), "c": random_fact(3, 3)})
    return store
