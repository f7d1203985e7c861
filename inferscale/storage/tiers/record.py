"""The store of record's contract: the calls the memory side, the scheduler and the memory tier's
loader make on ``Config.store`` (:func:`~inferscale.storage.tiers.store_of_record`).

It is the one store writers write and every other tier is a cache of: the disk store (``"disk"``,
under ``<data_dir>/kv``, or any ``root``, a shared filesystem included) or a networked one
(``"redis"``: :class:`~inferscale.storage.redis.store.RedisStore`) that replicas share. Beyond
:class:`~inferscale.storage.base.KVStore` it commits a fact whole with its record and embedding
(``put(..., records, embeddings, drop)``), and serves the records, the embeddings, one version of a
whole user (``read_user``) and the user's epoch, which changes with every write and is what
per-replica caches (memory tiers, retrieval indexes, cache salts) are invalidated by.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Protocol

import torch

from inferscale.errors import ConfigError
from inferscale.facts import Fact
from inferscale.kv import FactKV, KVBatch
from inferscale.kv_fp8 import Fp8KV

class StoreOfRecord(Protocol):
    """The calls made on ``Config.store`` (what :class:`~inferscale.storage.base.KVStore` offers, and
    the records, embeddings and whole-user reads of :mod:`inferscale.storage.format.reads`)."""

    name: ClassVar[str]

    def put(self, user_id: str, facts: Mapping[str, FactKV | Fp8KV], records: Mapping[str, Fact] | None = None,
            embeddings: Mapping[str, torch.Tensor] | None = None, drop: Sequence[str] = ()) -> None: ...

    def get(self, user_id: str, fact_ids: Sequence[str], device: torch.device | str | None = None) -> KVBatch: ...

    def delete(self, user_id: str, fact_ids: Sequence[str] | None = None) -> None: ...

    def list(self, user_id: str) -> list[str]: ...

    def users(self) -> list[str]: ...

    def nbytes(self, user_id: str) -> int: ...

    def epoch(self, user_id: str) -> str | None: ...

    def token_ids(self, user_id: str, fact_ids: Sequence[str]) -> list[tuple[int, ...]]: ...

    def epoch_token_ids(self, user_id: str, fact_ids: Sequence[str]) -> tuple[str, list[tuple[int, ...]]]: ...

    def facts(self, user_id: str) -> dict[str, Fact]: ...

    def embeddings(self, user_id: str) -> tuple[list[str], torch.Tensor]: ...

    def read_user(self, user_id: str) -> tuple[str, dict[str, FactKV | Fp8KV]]: ...

    def sweep(self) -> list[str]: ...


#: every name of the contract: ``name``, then its calls
CONTRACT = ("name", *(n for n, call in vars(StoreOfRecord).items() if callable(call) and not n.startswith("_")))


def check_record_store(store: object) -> StoreOfRecord:
    """``store``, checked to be durable and to offer every call of the contract; a
    :class:`ConfigError` names what it lacks."""
    missing = [n for n in CONTRACT if not hasattr(store, n) or (n != "name" and not callable(getattr(store, n)))]
    cls = type(store)
    where = f"store {getattr(store, 'name', '?')!r} ({cls.__module__}.{cls.__qualname__})"
    if getattr(store, "volatile", True):
        raise ConfigError(f"{where} keeps K/V in process memory: the store of record must be durable "
                          f"(disk, redis or a plugin's)")
    if missing:
        raise ConfigError(f"{where} cannot be the store of record: it lacks {', '.join(missing)} "
                          f"(the contract: inferscale.storage.tiers.record.StoreOfRecord)")
    return store
