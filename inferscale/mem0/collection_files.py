"""One Mem0 collection on disk: a file per retriever user, holding its memories' ids, vectors and payloads.

Layout (under the store's ``root``, e.g. ``<data_dir>/mem0/vectors/<collection>``)::

    users/<user_file_stem>.safetensors   tensor "vectors" [n, dim] float32; metadata: format,
                                         user_id, ids (JSON list), payloads (JSON list)
    .lock                                writers' lock

A user's file is rewritten whole on every change to that user's memories (temp
file, fsync, rename: a crash leaves the old or the new version), so a write
costs O(memories of that user). One process writes a collection at a time;
the lock only keeps two writers' renames from interleaving. Nothing is created
before the first write, so a collection that is only read leaves no trace.

A file that cannot be read (cut short, empty, altered, a directory in its
place) is that user's loss alone: :meth:`CollectionFiles.load` reports it as
:class:`Unreadable`, naming the file by its place in the collection, never by
its path on this machine.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from inferscale import files
from inferscale.errors import CorruptDataError
from inferscale.facts import user_file_stem, user_from_file_stem

FORMAT = "inferscale-mem0/1"
SUFFIX = ".safetensors"


@dataclass(frozen=True)
class UserMemories:
    """What one file holds: a retriever user's memories, row ``i`` of ``vectors`` is ``ids[i]``."""

    user_id: str
    ids: list[str]
    vectors: torch.Tensor
    payloads: list[dict]


@dataclass(frozen=True)
class Unreadable:
    """A user whose file could not be read: ``reason`` names the file within the collection."""

    user_id: str
    reason: str


class CollectionFiles:
    """Reads and writes the per-user files of one collection (see the module docstring)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        self.users_dir = self.root / "users"

    def load(self) -> Iterator[UserMemories | Unreadable]:
        """Every stored user's memories, in file-name order; an unreadable file as :class:`Unreadable`."""
        if not self.users_dir.is_dir():
            return
        for path in sorted(self.users_dir.glob(f"*{SUFFIX}")):
            try:
                yield read_user_file(path)
            except CorruptDataError as exc:
                yield Unreadable(user_from_file_stem(path.name[: -len(SUFFIX)]), str(exc))

    def save(self, user: UserMemories) -> None:
        """Replace the user's file; a user with no memories has none."""
        path = self.path(user.user_id)
        if not user.ids and not self.users_dir.is_dir():
            return
        files.make_dir(self.users_dir)
        with files.exclusive_lock(self.root / ".lock"):
            if not user.ids:
                files.remove(path)
                return
            files.atomic_write(path, encode(user))

    def remove_all(self) -> None:
        if not self.users_dir.is_dir():
            return
        with files.exclusive_lock(self.root / ".lock"):
            for path in self.users_dir.glob(f"*{SUFFIX}"):
                _remove(path)

    def remove(self, user_id: str) -> int:
        """Delete the user's file; the memories it held (0 if none, or if it was unreadable)."""
        path = self.path(user_id)
        if not self.users_dir.is_dir():
            return 0
        with files.exclusive_lock(self.root / ".lock"):
            if not path.exists():
                return 0
            try:
                held = len(read_user_file(path).ids)
            except CorruptDataError:  # unreadable: removed all the same
                held = 0
            _remove(path)
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
    """One user's file, checked for format, shapes and owner; :class:`CorruptDataError` (naming the file
    as ``users/<name>``) if it is not one."""
    where = f"users/{path.name}"
    try:
        with safe_open(str(path), "pt") as fh:
            metadata, vectors = fh.metadata() or {}, fh.get_tensor("vectors")
        user = UserMemories(metadata["user_id"], json.loads(metadata["ids"]), vectors, json.loads(metadata["payloads"]))
        problem = _problem(user, metadata.get("format"), path.name)
    except Exception as exc:  # anything unreadable is corrupt, whatever the parser raised
        raise CorruptDataError(f"{where}: not a readable {FORMAT} file ({_without_paths(exc, path)})") from None
    if problem:
        raise CorruptDataError(f"{where}: {problem}")
    return user


def _problem(user: UserMemories, format_name: str | None, name: str) -> str | None:
    """What makes a parsed file not a user's memories (``None``: nothing)."""
    if format_name != FORMAT:
        return f"format {format_name!r}, not {FORMAT!r}"
    if not isinstance(user.ids, list) or not isinstance(user.payloads, list) or user.vectors.ndim != 2 \
            or not _same_lengths(user):
        return f"ids, payloads and vectors {tuple(user.vectors.shape)} do not match"
    if not isinstance(user.user_id, str) or f"{user_file_stem(user.user_id, check=False)}{SUFFIX}" != name:
        return f"holds the memories of user {user.user_id!r}, not those of its name's"
    return None


def _without_paths(exc: BaseException, path: Path) -> str:
    """What went wrong, without where on this machine the file is."""
    text = f"{type(exc).__name__}: {getattr(exc, 'strerror', None) or exc}"
    return text.replace(str(path), path.name).replace(str(path.parent), "users")


def _remove(path: Path) -> None:
    """A user's file, or a directory found in its place."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        files.remove(path)


def _same_lengths(user: UserMemories) -> bool:
    return (user.vectors.shape[0] == len(user.ids) == len(user.payloads)
            and all(isinstance(i, str) for i in user.ids) and all(isinstance(p, dict) for p in user.payloads))
