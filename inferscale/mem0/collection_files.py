"""One Mem0 collection on disk: a file per retriever user, holding its memories' ids, vectors and payloads.

Layout (under the store's ``root``, e.g. ``<data_dir>/mem0/vectors/<collection>``)::

    users/<user_file_stem>.safetensors   tensor "vectors" [n, dim] float32; metadata: format,
                                         user_id, ids (JSON list), payloads (JSON list)
    .lock                                writers' lock

A user's file is rewritten whole on every change to that user's memories (temp
file, fsync, rename: a crash leaves the old or the new version), so a write
costs O(memories of that user). One process writes a collection at a time;
the lock only keeps two writers' renames from interleaving.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from inferscale.errors import CorruptDataError
from inferscale.facts import user_file_stem
from inferscale import files

FORMAT = "inferscale-mem0/1"
SUFFIX = ".safetensors"


@dataclass(frozen=True)
class UserMemories:
    """What one file holds: a retriever user's memories, row ``i`` of ``vectors`` is ``ids[i]``."""

    user_id: str
    ids: list[str]
    vectors: torch.Tensor
    payloads: list[dict]


class CollectionFiles:
    """Reads and writes the per-user files of one collection (see the module docstring)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        self.users_dir = self.root / "users"
        files.make_dir(self.users_dir)

    def load(self) -> Iterator[UserMemories]:
        """Every stored user's memories, in file-name order."""
        for path in sorted(self.users_dir.glob(f"*{SUFFIX}")):
            yield read_user_file(path)

    def save(self, user: UserMemories) -> None:
        """Replace the user's file; a user with no memories has none."""
        path = self.path(user.user_id)
        with files.exclusive_lock(self.root / ".lock"):
            if not user.ids:
                files.remove(path)
                return
            files.atomic_write(path, encode(user))

    def remove_all(self) -> None:
        with files.exclusive_lock(self.root / ".lock"):
            for path in self.users_dir.glob(f"*{SUFFIX}"):
                files.remove(path)

    def remove(self, user_id: str) -> int:
        """Delete the user's file; the memories it held (0 if none, or if it was unreadable)."""
        path = self.path(user_id)
        with files.exclusive_lock(self.root / ".lock"):
            if not path.exists():
                return 0
            try:
                held = len(read_user_file(path).ids)
            except CorruptDataError:  # unreadable: removed all the same
                held = 0
            files.remove(path)
            return held

    def path(self, user_id: str) -> Path:
        return self.users_dir / f"{user_file_stem(user_id, check=False)}{SUFFIX}"


def forget_user_files(vectors_root: str | Path, user_id: str) -> int:
    """Delete ``user_id``'s file in every collection under ``vectors_root`` (``<data_dir>/mem0/vectors``,
    where Mem0's memories live when InferScale is its vector store); the memories they held."""
    root = Path(vectors_root).expanduser()
    if not root.is_dir():
        return 0
    return sum(CollectionFiles(c).remove(user_id) for c in sorted(root.iterdir()) if (c / "users").is_dir())


def encode(user: UserMemories) -> bytes:
    if user.vectors.ndim != 2 or not _same_lengths(user):
        raise ValueError(f"{len(user.ids)} ids, {len(user.payloads)} payloads, vectors {tuple(user.vectors.shape)}")
    metadata = {"format": FORMAT, "user_id": user.user_id, "ids": json.dumps(user.ids),
                "payloads": json.dumps(user.payloads, ensure_ascii=False)}
    vectors = user.vectors.detach().to("cpu", torch.float32).contiguous()
    return st_save({"vectors": vectors}, metadata)


def read_user_file(path: Path) -> UserMemories:
    """One user's file, checked for format and shapes; :class:`CorruptDataError` if it is not one."""
    try:
        with safe_open(str(path), "pt") as fh:
            metadata, vectors = fh.metadata() or {}, fh.get_tensor("vectors")
        user = UserMemories(metadata["user_id"], json.loads(metadata["ids"]), vectors, json.loads(metadata["payloads"]))
    except Exception as exc:  # anything unreadable is corrupt, whatever the parser raised
        raise CorruptDataError(f"{path}: not a readable {FORMAT} file ({exc!r})") from exc
    if metadata.get("format") != FORMAT or vectors.ndim != 2 or not _same_lengths(user):
        raise CorruptDataError(f"{path}: format {metadata.get('format')!r}, {len(user.ids)} ids, "
                               f"{len(user.payloads)} payloads, vectors {tuple(vectors.shape)}")
    return user


def _same_lengths(user: UserMemories) -> bool:
    return (user.vectors.shape[0] == len(user.ids) == len(user.payloads)
            and all(isinstance(i, str) for i in user.ids) and all(isinstance(p, dict) for p in user.payloads))
