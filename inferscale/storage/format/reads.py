"""What a store of record answers from its users' indexes alone, the same for every store.

A store of record (the disk store, the Redis store) keeps each user as a format-3 index
(:class:`~inferscale.storage.format.index.UserIndex`) and its segments. :class:`IndexReads` derives the
readers that need nothing but the index (fact ids, bytes, token ids, records) and the verified
whole-user read from two methods the store provides: ``_index(user_id)`` (the index, or None for
an unknown user) and ``_read(user_id, None)`` (the index and every fact, verified).
:func:`fresh_user_file` checks and packs what a ``put`` writes, before either store commits it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from inferscale.devices import resolve_device
from inferscale.errors import UnknownUserError
from inferscale.facts import Fact
from inferscale.kv import FactKV, KVBatch
from inferscale.kv_fp8 import MODEL, Fp8KV, at_rest
from inferscale.storage.blocks import empty_batch
from inferscale.storage.format import kvfile
from inferscale.storage.format.index import UserIndex
from inferscale.storage.layout import KVLayout, check_layout, require_facts


class IndexReads:
    """Readers of a store of record that follow from its users' indexes."""

    def _index(self, user_id: str) -> UserIndex | None:
        raise NotImplementedError

    def _read(self, user_id: str, fact_ids: Sequence[str] | None) -> tuple[UserIndex, kvfile.UserFile]:
        raise NotImplementedError

    def get(self, user_id: str, fact_ids: Sequence[str], device: torch.device | str | None = None) -> KVBatch:
        """The facts' K/V, concatenated in ``fact_ids`` order, on ``device`` (each segment read verified)."""
        target = resolve_device(device, torch.device("cpu"))
        fact_ids = list(fact_ids)
        if not fact_ids:
            index = self._index(user_id)
            return empty_batch(index.layout if index else None, target)
        _, user = self._read(user_id, fact_ids)
        return batch_of(fact_ids, [user.facts[f] for f in fact_ids], target)

    def list(self, user_id: str) -> list[str]:
        index = self._index(user_id)
        return list(index.facts) if index else []

    def nbytes(self, user_id: str) -> int:
        """Bytes of K/V (not of the files or values holding them) stored for the user."""
        index = self._index(user_id)
        return index.nbytes if index else 0

    def token_ids(self, user_id: str, fact_ids: Sequence[str]) -> list[tuple[int, ...]]:
        return self.epoch_token_ids(user_id, fact_ids)[1]

    def epoch_token_ids(self, user_id: str, fact_ids: Sequence[str]) -> tuple[str, list[tuple[int, ...]]]:
        """Both from one version of the user's index."""
        index = self._require_index(user_id)
        require_facts(user_id, fact_ids, index.facts)
        return index.epoch, [index.facts[f].token_ids for f in fact_ids]

    def stored_lengths(self, user_id: str, fact_ids: Sequence[str]) -> tuple[str | None, list[int]]:
        """(the user's epoch, each fact's length in tokens) from one version of the index: None and
        0 for a user or a fact not stored, read at the same cost as when they are."""
        index = self._index(user_id)
        facts = index.facts if index is not None else {}
        return (index.epoch if index is not None else None), [len(_entry(facts, f)) for f in fact_ids]

    def load_user(self, user_id: str) -> dict[str, FactKV | Fp8KV]:
        """All of the user's facts on the CPU, verified, as they are kept (Fp8KV in fp8)."""
        return self.read_user(user_id)[1]

    def read_user(self, user_id: str) -> tuple[str, dict[str, FactKV | Fp8KV]]:
        """(epoch, all facts verified, in order, as they are kept) of one version of the user (to
        fill a memory tier)."""
        index, user = self._read(user_id, None)
        return index.epoch, {f: user.facts[f] for f in index.facts}

    def facts(self, user_id: str) -> dict[str, Fact]:
        """The user's facts (text, source turn, token ids), no K/V read; a fact
        stored without a record has empty text."""
        index = self._index(user_id)
        if index is None:
            return {}
        out = {}
        for fact_id, entry in index.facts.items():
            record = entry.record or {}
            out[fact_id] = Fact(fact_id, user_id, record.get("text", ""), record.get("source_turn"), entry.token_ids)
        return out

    def _require_index(self, user_id: str) -> UserIndex:
        index = self._index(user_id)
        if index is None:
            raise UnknownUserError(user_id)
        return index


_NO_TOKENS: tuple[int, ...] = ()


def _entry(facts: Mapping, fact_id: str) -> tuple[int, ...]:
    entry = facts.get(fact_id)
    return entry.token_ids if entry is not None else _NO_TOKENS


def batch_of(fact_ids: Sequence[str], kvs: Sequence[FactKV | Fp8KV], device: torch.device) -> KVBatch:
    """The facts' K/V in the model's dtype (fp8 ones dequantized), concatenated, on ``device``."""
    kvs = [at_rest(kv, MODEL) for kv in kvs]
    keys = torch.cat([kv.keys for kv in kvs], dim=1).to(device)
    values = torch.cat([kv.values for kv in kvs], dim=1).to(device)
    return KVBatch(list(fact_ids), [kv.token_ids for kv in kvs], keys, values)


def fresh_user_file(user_id: str, facts: Mapping[str, FactKV | Fp8KV], records: Mapping[str, Fact] | None,
                    embeddings: Mapping[str, torch.Tensor] | None) -> tuple[KVLayout, kvfile.UserFile]:
    """The layout and the packed segment of a ``put`` of ``facts`` (non-empty) with their
    ``records`` and ``embeddings``, checked: one layout, and no record or embedding of a fact
    not being put."""
    layout = check_layout(user_id, facts, None)
    records, embeddings = dict(records or {}), dict(embeddings or {})
    if not set(records) | set(embeddings) <= set(facts):
        raise ValueError("records and embeddings must belong to the facts being put")
    return layout, kvfile.UserFile(layout, dict(facts),
                                   {f: {"text": r.text, "source_turn": r.source_turn} for f, r in records.items()},
                                   {f: e.detach().to("cpu", torch.float32).reshape(-1) for f, e in embeddings.items()})
