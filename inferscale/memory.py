"""The fact catalog: each user's facts (text, source turn, token ids) and their
embeddings, persisted as one JSON file per user so a restart re-indexes them."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from inferscale.errors import CorruptDataError
from inferscale.facts import Fact, check_id

FORMAT_VERSION = 1


class FactCatalog:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def _path(self, user_id: str) -> Path:
        return self.root / f"{check_id(user_id, 'user_id')}.json"

    def put(self, user_id: str, facts: Sequence[Fact], embeddings: torch.Tensor) -> None:
        """Add or replace facts (and their embedding rows) of one user."""
        if len(facts) != embeddings.shape[0]:
            raise ValueError(f"{len(facts)} facts but {embeddings.shape[0]} embeddings")
        records = {r["fact_id"]: r for r in self._read(user_id)}
        for fact, vector in zip(facts, embeddings.tolist()):
            if fact.user_id != user_id:
                raise ValueError(f"fact {fact.fact_id} belongs to {fact.user_id!r}, not {user_id!r}")
            records[fact.fact_id] = {
                "fact_id": fact.fact_id, "text": fact.text, "source_turn": fact.source_turn,
                "token_ids": list(fact.token_ids), "embedding": vector,
            }
        self._write(user_id, list(records.values()))

    def facts(self, user_id: str) -> dict[str, Fact]:
        return {r["fact_id"]: Fact(r["fact_id"], user_id, r["text"], r["source_turn"], tuple(r["token_ids"]))
                for r in self._read(user_id)}

    def embeddings(self, user_id: str) -> tuple[list[str], torch.Tensor]:
        records = self._read(user_id)
        if not records:
            return [], torch.empty(0, 0)
        return [r["fact_id"] for r in records], torch.tensor([r["embedding"] for r in records], dtype=torch.float32)

    def users(self) -> list[str]:
        return sorted(p.stem for p in self.root.glob("*.json")) if self.root.is_dir() else []

    def delete(self, user_id: str) -> None:
        self._path(user_id).unlink(missing_ok=True)

    def _read(self, user_id: str) -> list[dict]:
        path = self._path(user_id)
        if not path.exists():
            return []
        try:
            data = json.loads(path.read_text())
            if data.get("version") != FORMAT_VERSION:
                raise ValueError(f"format version {data.get('version')!r}, expected {FORMAT_VERSION}")
            return list(data["facts"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptDataError(f"fact catalog {path} is unreadable: {exc}") from exc

    def _write(self, user_id: str, records: list[dict]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self._path(user_id)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({"version": FORMAT_VERSION, "user_id": user_id, "facts": records}, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
