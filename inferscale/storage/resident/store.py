"""What the in-process (volatile) stores share: users' facts held as blocks, within a byte budget.

A subclass decides only *where* blocks live (:meth:`ResidentStore._place`); the
bookkeeping, the budget, the errors and the gather are here. Each user's
state is one immutable :class:`UserKV` swapped in whole, so ``get`` reads a
consistent snapshot without taking a lock while writers (serialised by a
lock) build the next one.

**Budget.** The store holds at most ``max_bytes`` (its users' K/V, counted as the memory their
buffers take: :meth:`ResidentStore.footprint`): by default (``"auto"``) the budget
the store's class picks for the machine it runs on (:meth:`ResidentStore.auto_max_bytes`: 4 GiB
for the GPU's own memory, a share of the host's memory for the pinned tier). Making room for a
user evicts whole users, least recently used first (``get`` counts as a
use); the users the library keeps for itself (ids starting with ``_``, i.e.
the instruction prefix every request reads) are never evicted. A user larger
than the room that can be made is refused (:class:`CapacityError`). While a
user is replaced, its old and new copies briefly coexist.

**Form.** The facts are kept in ``Config.kv_dtype_at_rest`` (the runtime key ``kv_dtype_at_rest``,
:func:`~inferscale.storage.tiers.build_tiers`): in the model's dtype, or in fp8 with each fact's
dequant beside its block (:mod:`inferscale.kv_fp8`), whatever form the disk tier keeps them in
(``put`` and ``load`` convert). One form for every user, the instruction prefix included, so that
one launch of the fused write reads a request's whole segment.

**Epoch.** Each user's copy carries the epoch of the version it
holds: the disk's, when it was loaded from there (:meth:`load`,
:func:`inferscale.storage.tiers.fill.ensure_user`), or a new one at every ``put``.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from inferscale.devices import auto_device, check_device, resolve_device, runtime_device
from inferscale.errors import CapacityError, UnknownUserError
from inferscale.kv import FactKV, KVBatch
from inferscale.kv_fp8 import MODEL, Fp8KV, all_at_rest, check_at_rest
from inferscale.storage.base import KVStore
from inferscale.storage.blocks import (HeldBlocks, batch_from_blocks, copy_rows, empty_batch, gather_blocks,
                                       gather_dequantized, move_blocks)
from inferscale.storage.format.index import new_epoch
from inferscale.storage.layout import KVLayout, check_ids, check_layout, is_internal, require_facts
from inferscale.storage.resident.lru import UsageOrder
from inferscale.storage.resident.user_kv import UserKV

#: what :meth:`ResidentStore._place` receives per fact: a block it already holds, or a new fact
#: (an Fp8KV where the store keeps fp8)
Source = torch.Tensor | FactKV | Fp8KV
#: the budget of the GPU memory tier (bytes of K/V) when none is set, and the least a
#: host-memory tier gets where a quarter of the machine's memory allows it
DEFAULT_MAX_BYTES = 4 << 30
#: ``max_bytes`` that asks the store for the budget it picks for this machine
AUTO = "auto"


class ResidentStore(KVStore):
    """Base of the stores that keep K/V in this process (HBM, pinned host memory): the
    built-in :class:`~inferscale.storage.tiers.memory.MemoryTier`."""

    volatile = True
    #: whether the blocks lie in page-locked host memory (:class:`~inferscale.storage.pinned.PinnedHostStore`
    #: sets it where CUDA exists)
    pinned: bool = False

    @dataclass(frozen=True)
    class Options:
        #: the device ``get`` delivers to by default (for hbm, also where K/V live);
        #: None: the current CUDA device if there is one, else the CPU
        device: str | None = None
        #: bytes of K/V held at most; least recently used users are evicted past it
        #: ("auto": the store's budget for this machine, :meth:`ResidentStore.auto_max_bytes`;
        #: None: no limit, only with ``unbounded``)
        max_bytes: int | str | None = AUTO
        #: allow ``max_bytes = None``: the tier then grows with every user loaded, up to the machine's memory
        unbounded: bool = False

        def __post_init__(self):
            check_device(self.device)
            value = self.max_bytes
            if not (value is None or _is_auto(value) or _is_byte_count(value)):
                raise ValueError(f"max_bytes must be an integer >= 0, {AUTO!r} or None, got {value!r}")
            if value is None and self.unbounded is not True:
                raise ValueError("max_bytes = None (no budget) holds every user loaded, up to the machine's "
                                 "memory; set unbounded = true beside it to mean that")

    def __init__(self, options: Options | None = None, **runtime: Any):
        """``runtime["device"]`` is used when the options name none; ``runtime["kv_dtype_at_rest"]``
        is the form the facts are kept in (default: the model's dtype); other runtime keys are ignored."""
        options = options or self.Options()
        #: the form every fact is kept in (``Config.kv_dtype_at_rest``)
        self.kv_dtype_at_rest = check_at_rest(runtime.get("kv_dtype_at_rest", MODEL))
        #: where ``get`` puts the batch when the caller names no device
        self.device = auto_device(options.device or runtime_device(runtime))
        #: bytes of K/V held at most (None: no limit); "auto" is resolved here, once
        self.max_bytes: int | None = self.auto_max_bytes() if _is_auto(options.max_bytes) else options.max_bytes
        self._users: dict[str, UserKV] = {}
        self._order = UsageOrder()
        self._write_lock = threading.Lock()

    @classmethod
    def auto_max_bytes(cls) -> int:
        """The budget ``max_bytes = "auto"`` stands for: :data:`DEFAULT_MAX_BYTES` (4 GiB) for a
        store in the GPU's memory, which the model and vLLM's cache share. A store whose memory
        is elsewhere overrides it (the pinned tier: a share of the host's memory,
        :func:`~inferscale.storage.host_budget.host_share`)."""
        return DEFAULT_MAX_BYTES

    @abstractmethod
    def _place(self, layout: KVLayout, sources: Mapping[str, Source]) -> dict[str, torch.Tensor]:
        """Blocks for every fact in ``sources`` (same order), in this store's memory, of
        ``layout.stored_dtype``."""

    def _place_dequant(self, dequant: Mapping[str, torch.Tensor], blocks: Mapping[str, torch.Tensor]
                       ) -> dict[str, torch.Tensor]:
        """fp8 facts' dequant (held or new), each beside its block of ``blocks``."""
        return {fact_id: d.to(blocks[fact_id].device) for fact_id, d in dequant.items()}

    def put(self, user_id: str, facts: Mapping[str, FactKV | Fp8KV]) -> None:
        """Add or replace facts of one user (a new epoch), kept in this store's form."""
        check_ids(user_id, facts)
        if not facts:
            return
        facts = all_at_rest(facts, self.kv_dtype_at_rest)
        check_layout(user_id, facts, None)
        with self._write_lock:
            old = self._users.get(user_id)
            layout = check_layout(user_id, facts, old.layout if old else None)
            sources: dict[str, Source] = dict(old.blocks) if old else {}
            token_ids = dict(old.token_ids) if old else {}
            sources.update(facts)
            token_ids.update((fact_id, kv.token_ids) for fact_id, kv in facts.items())
            self._make_room(user_id, _nbytes(layout, token_ids.values()))
            self._install(user_id, self._user(layout, sources, token_ids, new_epoch(), old))

    def load(self, user_id: str, facts: Mapping[str, FactKV | Fp8KV], epoch: str) -> None:
        """Hold exactly ``facts`` for the user (in this store's form), as version ``epoch`` of another
        tier. Raises :class:`CapacityError` (holding nothing for the user) when they do not fit."""
        check_ids(user_id, facts)
        facts = all_at_rest(facts, self.kv_dtype_at_rest)
        layout = check_layout(user_id, facts, None)
        with self._write_lock:
            self._drop(user_id)
            if layout is None:
                return
            token_ids = {fact_id: kv.token_ids for fact_id, kv in facts.items()}
            self._make_room(user_id, _nbytes(layout, token_ids.values()))
            self._install(user_id, self._user(layout, facts, token_ids, epoch))

    def get(self, user_id: str, fact_ids: Sequence[str], device: torch.device | str | None = None) -> KVBatch:
        target = resolve_device(device, self.device)
        fact_ids = list(fact_ids)
        user = self._users.get(user_id)
        if not fact_ids:
            return empty_batch(user.layout if user else None, target)
        user = self._require(user_id, user)
        require_facts(user_id, fact_ids, user.blocks)
        self._order.touch(user_id)
        blocks = [user.blocks[f] for f in fact_ids]
        stacked = gather_dequantized(blocks, [user.dequant[f] for f in fact_ids], user.layout.dtype, target) \
            if user.layout.fp8 else gather_blocks(blocks, target)
        return batch_from_blocks(fact_ids, [user.token_ids[f] for f in fact_ids], stacked)

    def blocks(self, user_id: str, fact_ids: Sequence[str], device: torch.device | str | None = None
               ) -> list[torch.Tensor]:
        """The facts' ``[2, L, T, H, D]`` blocks on ``device``, for a reader that takes them as
        they are (the fused cache write): the held blocks themselves when they already lie
        there (no copy; the caller must not write to them), else a copy of each there (no
        gather into one block: the reader takes a list). In fp8: e4m3 blocks."""
        return self._moved(user_id, fact_ids, device, "blocks")

    def _moved(self, user_id: str, fact_ids: Sequence[str], device, part: str) -> list[torch.Tensor]:
        """The facts' blocks (``part="blocks"``) or fp8 dequant (``"dequant"``; none in the model's
        dtype) on ``device``, as :meth:`blocks` says."""
        target = resolve_device(device, self.device)
        user = self._require(user_id, self._users.get(user_id))
        require_facts(user_id, fact_ids, user.blocks)
        self._order.touch(user_id)
        held = [getattr(user, part)[f] for f in fact_ids] if part == "blocks" or user.layout.fp8 else []
        if not held or all(tensor.device == target for tensor in held):
            return held
        return move_blocks(held, target)

    def held_rows(self, user_id: str, fact_ids: Sequence[str], device: torch.device | str | None = None
                  ) -> tuple[HeldBlocks, np.ndarray | None]:
        """For the fused cache write: the user's blocks with their addresses, where they lie on
        ``device``, and the rows of ``fact_ids`` among them (int64), looked up in the user's table
        without inspecting a block; facts wanted on another device: copies of their blocks there,
        in order (rows None)."""
        target = resolve_device(device, self.device)
        user = self._require(user_id, self._users.get(user_id))
        row_of, held = user.held
        try:
            rows = np.fromiter(map(row_of.__getitem__, fact_ids), np.int64, len(fact_ids))
        except KeyError:
            require_facts(user_id, fact_ids, row_of)
            raise
        self._order.touch(user_id)
        if user.device == target:
            return held, rows
        if not len(rows):  # (a pinned store's blocks wanted on a GPU, from here on)
            return HeldBlocks.empty(user.layout), None
        copied = copy_rows(held, rows, target)  # a copy per run of facts back to back in the user's buffer
        return (self._copy_each(user_id, fact_ids, target) if copied is None else copied), None

    def _copy_each(self, user_id: str, fact_ids: Sequence[str], device: torch.device) -> HeldBlocks:
        """The facts' blocks copied to ``device`` one by one (an allocation and a copy each), with
        their dequant there: where :func:`copy_rows` cannot pack them."""
        layout = self._users[user_id].layout
        return HeldBlocks.of(self.blocks(user_id, fact_ids, device), self._moved(user_id, fact_ids, device, "dequant"),
                             layout)

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
                self._drop(user_id)
                return
            token_ids = {f: old.token_ids[f] for f in keep}
            self._install(user_id, self._user(old.layout, keep, token_ids, new_epoch(), old))

    def list(self, user_id: str) -> list[str]:
        user = self._users.get(user_id)
        return list(user.blocks) if user else []

    def users(self) -> list[str]:
        return list(self._users)

    def nbytes(self, user_id: str) -> int:
        user = self._users.get(user_id)
        return user.nbytes if user else 0

    def epoch(self, user_id: str) -> str | None:
        user = self._users.get(user_id)
        return user.epoch if user else None

    def check_room(self, user_id: str, nbytes: int) -> None:
        """Raise :class:`CapacityError` when ``nbytes`` exceed what evicting every other user
        (except the never-evicted internal ones) would free."""
        if self.max_bytes is None:
            return
        kept = sum(self.footprint(u.nbytes) for uid, u in list(self._users.items())
                   if uid != user_id and is_internal(uid))
        if self.footprint(nbytes) > self.max_bytes - kept:
            raise CapacityError(f"kv_store {self.name!r}: user {user_id!r} needs {nbytes} bytes of K/V; at most "
                                f"{self.max_bytes - kept} of max_bytes={self.max_bytes} can be freed (refused "
                                f"before it was read)")

    def resident_bytes(self) -> int:
        """Bytes of K/V held for every user (at most ``max_bytes``)."""
        return sum(user.nbytes for user in list(self._users.values()))

    def footprint(self, nbytes: int) -> int:
        """The memory a user of ``nbytes`` of K/V takes in this store: what the budget counts (the
        K/V itself here; more where the allocator rounds a buffer up)."""
        return nbytes

    def _held_bytes(self, user_id: str) -> int:
        user = self._users.get(user_id)
        return self.footprint(user.nbytes) if user else 0

    # -- internals (the write lock is held) -------------------------------------------

    def _make_room(self, user_id: str, need: int) -> None:
        """Evict least recently used users until a user of ``need`` bytes of K/V fits beside the
        others (each counted by :meth:`footprint`)."""
        if self.max_bytes is None:
            return
        need = self.footprint(need)
        others = sum(map(self._held_bytes, list(self._users))) - self._held_bytes(user_id)
        while others + need > self.max_bytes:
            victim = self._order.oldest(spare=lambda u: u == user_id or is_internal(u))
            if victim is None:
                raise CapacityError(
                    f"kv_store {self.name!r}: user {user_id!r} needs {need} bytes of K/V; at most "
                    f"{self.max_bytes - others} of max_bytes={self.max_bytes} can be freed "
                    f"(users whose id starts with '_' are never evicted)")
            others -= self._held_bytes(victim)
            self._drop(victim)

    def _user(self, layout: KVLayout, sources: Mapping[str, Source], token_ids: dict[str, tuple[int, ...]],
              epoch: str, held: UserKV | None = None) -> UserKV:
        """A user's facts placed in this store's memory; in fp8 each with its dequant (a new fact's
        own, or the one ``held`` beside the block)."""
        blocks = self._place(layout, sources)
        if not layout.fp8:
            return UserKV(layout, blocks, token_ids, epoch)
        dequant = {f: src.dequant if isinstance(src, Fp8KV) else held.dequant[f] for f, src in sources.items()}
        return UserKV(layout, blocks, token_ids, epoch, self._place_dequant(dequant, blocks))

    def _install(self, user_id: str, user: UserKV) -> None:
        self._users[user_id] = user
        self._order.add(user_id)

    def _drop(self, user_id: str) -> None:
        self._users.pop(user_id, None)
        self._order.forget(user_id)

    @staticmethod
    def _require(user_id: str, user: UserKV | None) -> UserKV:
        if user is None:
            raise UnknownUserError(user_id)
        return user


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def _is_byte_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _nbytes(layout: KVLayout, token_ids) -> int:
    return layout.nbytes(len(ids) for ids in token_ids)


__all__ = ["AUTO", "DEFAULT_MAX_BYTES", "ResidentStore", "Source", "UserKV"]
