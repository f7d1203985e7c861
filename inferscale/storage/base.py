"""The KVStore interface: where facts' pre-RoPE K/V live, per user."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch

from inferscale.errors import MissingFactError, UnknownUserError
from inferscale.kv import FactKV, KVBatch


class KVStore(ABC):
    """Stores facts' K/V keyed by ``(user_id, fact_id)``.

    ``get`` returns the requested facts, in the requested order, on ``device``
    as one :class:`~inferscale.kv.KVBatch` (contiguous per layer). Unknown users
    raise :class:`~inferscale.errors.UnknownUserError`, unknown facts
    :class:`~inferscale.errors.MissingFactError`; corrupt data raises
    :class:`~inferscale.errors.CorruptDataError` and is never returned.

    A store selected as the worker's memory tier (``Config.kv_store``) offers more, the calls of
    :class:`~inferscale.storage.tiers.memory.MemoryTier`, checked when the tiers are built.
    """

    name: ClassVar[str]
    #: True when K/V live in process memory (so a backing tier is needed to persist)
    volatile: ClassVar[bool] = True

    @abstractmethod
    def put(self, user_id: str, facts: Mapping[str, FactKV]) -> None:
        """Add or replace facts of one user."""

    @abstractmethod
    def get(self, user_id: str, fact_ids: Sequence[str], device: torch.device | str | None = None) -> KVBatch:
        """The facts' K/V, concatenated in ``fact_ids`` order, on ``device``."""

    @abstractmethod
    def delete(self, user_id: str, fact_ids: Sequence[str] | None = None) -> None:
        """Forget some facts of a user, or the whole user when ``fact_ids`` is None."""

    @abstractmethod
    def list(self, user_id: str) -> list[str]:
        """The user's fact_ids (empty when the user is unknown)."""

    @abstractmethod
    def users(self) -> list[str]:
        """Every user with stored facts."""

    @abstractmethod
    def nbytes(self, user_id: str) -> int:
        """Bytes of K/V held for the user."""

    @abstractmethod
    def epoch(self, user_id: str) -> str | None:
        """The epoch of the user's facts this store holds: an id that changes
        whenever they change and is never reused (None: the store holds no facts
        of the user). It keys the user's cache salts (:mod:`inferscale.compose.salt`)."""

    def token_ids(self, user_id: str, fact_ids: Sequence[str]) -> list[tuple[int, ...]]:
        """The facts' token ids (no K/V moved); default goes through :meth:`get`."""
        return self.get(user_id, fact_ids, "cpu").token_ids

    def epoch_token_ids(self, user_id: str, fact_ids: Sequence[str]) -> tuple[str, list[tuple[int, ...]]]:
        """(the user's epoch, the facts' token ids); a store that can reads both from one
        version (the default reads them one after the other). Raises :class:`UnknownUserError`
        and :class:`MissingFactError` as :meth:`token_ids` does."""
        token_ids = self.token_ids(user_id, fact_ids)
        epoch = self.epoch(user_id)
        if epoch is None:  # deleted since its token ids were read
            raise UnknownUserError(user_id)
        return epoch, token_ids

    def stored_lengths(self, user_id: str, fact_ids: Sequence[str]) -> tuple[str | None, list[int]]:
        """(the user's epoch, each fact's length in tokens), None and 0 standing in for a user or
        a fact not stored, never raising for either: what the planner checks a hand-built
        request's salt against before it tells them apart. The stores of record read both from
        one version of the index, at the same cost whether the user and the facts exist or not
        (:class:`~inferscale.storage.format.reads.IndexReads`); this default goes fact by fact."""
        lengths = []
        for fact_id in fact_ids:
            try:
                lengths.append(len(self.token_ids(user_id, [fact_id])[0]))
            except (UnknownUserError, MissingFactError):
                lengths.append(0)
        return self.epoch(user_id), lengths

    def has_user(self, user_id: str) -> bool:
        return bool(self.list(user_id))

    def check_room(self, user_id: str, nbytes: int) -> None:
        """Raise :class:`CapacityError` when a user of ``nbytes`` of K/V could never be held, so a
        caller refuses them before reading them; a store without a budget holds anyone."""
