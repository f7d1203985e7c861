"""What the in-process (volatile) stores share: users' facts held as blocks.

A subclass decides only *where* blocks live (:meth:`ResidentStore._place`); the
bookkeeping, the errors and the gather are here. Each user's state is one
immutable :class:`UserKV` swapped in whole, so ``get`` reads a consistent
snapshot without taking a lock while writers (serialised by a lock) build
the next one.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inferscale.devices import auto_device, check_device, resolve_device, runtime_device
from inferscale.errors import UnknownUserError
from inferscale.kv import FactKV, KVBatch
from inferscale.storage.base import KVStore
from inferscale.storage.blocks import batch_from_blocks, empty_batch, gather_blocks
from inferscale.storage.layout import KVLayout, check_ids, check_layout, require_facts

#: what :meth:`ResidentStore._place` receives per fact: a block it already holds, or a new fact
Source = torch.Tensor | FactKV


@dataclass(frozen=True)
class UserKV:
    """One user's facts: blocks ``[2, L, T, H, D]`` and token ids, in insertion order."""

    layout: KVLayout
    blocks: Mapping[str, torch.Tensor]
    token_ids: Mapping[str, tuple[int, ...]]

    @property
    def nbytes(self) -> int:
        return sum(len(ids) for ids in self.token_ids.values()) * self.layout.token_nbytes()


class ResidentStore(KVStore):
    """Base of the stores that keep K/V in this process (HBM, pinned host memory)."""

    volatile = True

    @dataclass(frozen=True)
    class Options:
        #: the device ``get`` delivers to by default (for hbm, also where K/V live);
        #: None: the current CUDA device if there is one, else the CPU
        device: str | None = None

        def __post_init__(self):
            check_device(self.device)

    def __init__(self, options: Options | None = None, **runtime: Any):
        """``runtime["device"]`` is used when the options name none; other runtime keys are ignored."""
        options = options or self.Options()
        #: where ``get`` puts the batch when the caller names no device
        self.device = auto_device(options.device or runtime_device(runtime))
        self._users: dict[str, UserKV] = {}
        self._write_lock = threading.Lock()

    @abstractmethod
    def _place(self, layout: KVLayout, sources: Mapping[str, Source]) -> dict[str, torch.Tensor]:
        """Blocks for every fact in ``sources`` (same order), in this store's memory."""

    def put(self, user_id: str, facts: Mapping[str, FactKV]) -> None:
        check_ids(user_id, facts)
        if not facts:
            return
        check_layout(user_id, facts, None)
        with self._write_lock:
            old = self._users.get(user_id)
            layout = check_layout(user_id, facts, old.layout if old else None)
            sources: dict[str, Source] = dict(old.blocks) if old else {}
            token_ids = dict(old.token_ids) if old else {}
            sources.update(facts)
            token_ids.update((fact_id, kv.token_ids) for fact_id, kv in facts.items())
            self._users[user_id] = UserKV(layout, self._place(layout, sources), token_ids)

    def get(self, user_id: str, fact_ids: Sequence[str], device: torch.device | str | None = None) -> KVBatch:
        target = resolve_device(device, self.device)
        fact_ids = list(fact_ids)
        user = self._users.get(user_id)
        if not fact_ids:
            return empty_batch(user.layout if user else None, target)
        user = self._require(user_id, user)
        require_facts(user_id, fact_ids, user.blocks)
        stacked = gather_blocks([user.blocks[f] for f in fact_ids], target)
        return batch_from_blocks(fact_ids, [user.token_ids[f] for f in fact_ids], stacked)

    def token_ids(self, user_id: str, fact_ids: Sequence[str]) -> list[tuple[int, ...]]:
        user = self._require(user_id, self._users.get(user_id))
        require_facts(user_id, fact_ids, user.token_ids)
        return [user.token_ids[f] for f in fact_ids]

    def delete(self, user_id: str, fact_ids: Sequence[str] | None = None) -> None:
        """Idempotent: unknown users and facts are ignored."""
        with self._write_lock:
            old = self._users.get(user_id)
            if old is None:
                return
            drop = set(old.blocks) if fact_ids is None else set(fact_ids)
            keep = {f: block for f, block in old.blocks.items() if f not in drop}
            if len(keep) == len(old.blocks):
                return
            if not keep:
                del self._users[user_id]
                return
            token_ids = {f: old.token_ids[f] for f in keep}
            self._users[user_id] = UserKV(old.layout, self._place(old.layout, keep), token_ids)

    def list(self, user_id: str) -> list[str]:
        user = self._users.get(user_id)
        return list(user.blocks) if user else []

    def users(self) -> list[str]:
        return list(self._users)

    def nbytes(self, user_id: str) -> int:
        user = self._users.get(user_id)
        return user.nbytes if user else 0

    @staticmethod
    def _require(user_id: str, user: UserKV | None) -> UserKV:
        if user is None:
            raise UnknownUserError(user_id)
        return user
