"""DiskStore: each user's facts as a small index plus append-only K/V segment files.

Format 3 (``docs/storage-format.md``; a user's directory and file names escape ``/``, ``\\``
and ``%`` in the id, :func:`~inferscale.facts.user_file_stem`)::

    <root>/users/<user_id>/index.json             facts, token ids, records, segments, epoch
    <root>/users/<user_id>/seg-<hex>.safetensors  K/V (and embeddings), never modified once written
    <root>/<user_id>.safetensors                  a format 1/2 file: read; its first write converts it
    <root>/.lock                                  writers' lock

Adding facts writes them as one new segment and replaces the index; it does
not rewrite what is stored, except the few newest small segments it merges
(:mod:`inferscale.storage.format.compaction`). Deleting or replacing a fact rewrites
the segments that held it, so its bytes leave the disk. Every file is written
to a temp file, fsynced and renamed (:mod:`inferscale.files`); the
index's rename is the commit: a crash leaves the old or the new version, and
files it left behind are removed by the next write (the writing side:
:mod:`inferscale.storage.disk.writes`). Writers take an exclusive ``flock`` on
``<root>/.lock``; readers take none (a segment removed under a reader sends it
back to the new index).

``list``/``token_ids``/``facts``/``nbytes``/``epoch`` read only the
index (verified by its own checksum; cached by the file's identity,
:mod:`inferscale.storage.format.index_cache`). Reads that return K/V (``get``, ``load_user``, ``read_user``) verify every segment
they read, whole, against its checksum and the index.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import torch

from inferscale.errors import CorruptDataError, UnknownUserError
from inferscale.facts import Fact, user_file_stem, user_from_file_stem
from inferscale.kv import FactKV
from inferscale.kv_fp8 import Fp8KV
from inferscale.storage.disk import legacy
from inferscale.storage.format import kvfile, nfc_names
from inferscale.storage.base import KVStore
from inferscale.storage.disk.writes import LOCK_NAME, SUFFIX, DiskWrites
from inferscale.storage.format.index import INDEX_NAME, UserIndex
from inferscale.storage.format.index_cache import DEFAULT_MIB, IndexCache, cache_bytes
from inferscale.storage.format.reads import IndexReads, fresh_user_file
from inferscale.storage.layout import check_ids, check_layout, require_facts
from inferscale.storage.format.segments import read_segments

__all__ = ["CACHE_BYTES", "LOCK_NAME", "READ_ATTEMPTS", "SUFFIX", "USERS_DIR", "DiskStore"]

USERS_DIR = "users"
#: the parsed indexes cached, at most, by default (an index holds every fact's token ids)
CACHE_BYTES = DEFAULT_MIB << 20
#: reads that find a segment gone (a writer replaced it) retry with the new index this often
READ_ATTEMPTS = 3


class DiskStore(DiskWrites, IndexReads, KVStore):
    """Durable K/V store; ``get`` reads, verifies and concatenates on the CPU, then moves."""

    name: ClassVar[str] = "disk"
    volatile: ClassVar[bool] = False

    @dataclass(frozen=True)
    class Options:
        #: directory of the users' files (created if missing; ``~`` expanded)
        root: str
        #: MiB of parsed indexes kept in memory (each counted at 5× its file), least recently used dropped
        index_cache_mib: int = DEFAULT_MIB

        def __post_init__(self):
            if not isinstance(self.root, str) or not self.root:
                raise ValueError(f"root must be a non-empty path string, got {self.root!r}")
            cache_bytes(self.index_cache_mib)

    def __init__(self, options: Options, **runtime: Any):
        """Runtime keywords are accepted and ignored (the root comes from the options)."""
        self.root = Path(os.path.expanduser(options.root))
        self.root.mkdir(parents=True, exist_ok=True)
        #: the users' parsed indexes while their files are unchanged
        self._indexes = IndexCache(cache_bytes(options.index_cache_mib))
        #: user -> (their index file, their format 1/2 file), as strings: every request stats
        #: the index a few times, and checking the id and building the paths cost more than the stat
        self._remembered_paths = lru_cache(maxsize=4096)(self._paths_of_index)
        nfc_names.migrate_disk(self.root, self.root / USERS_DIR, SUFFIX, self._writer)

    # -- the KVStore interface -------------------------------------------------

    def put(self, user_id: str, facts: Mapping[str, FactKV | Fp8KV], records: Mapping[str, Fact] | None = None,
            embeddings: Mapping[str, torch.Tensor] | None = None, drop: Sequence[str] = ()) -> None:
        """Add or replace facts: appended as one new segment, committed by one index write.

        ``records`` (text and source turn) and ``embeddings`` of those facts, when
        given, are committed in the same write: a fact is stored whole or not at all.
        ``drop`` names stored facts removed by the same write (a fact replaced by
        one under another id: the one or the other is stored, never both). Facts are kept as
        given: a FactKV in the model's dtype, an Fp8KV in fp8 (:mod:`inferscale.kv_fp8`); a write
        in the other form converts the user's stored facts to it.
        """
        check_ids(user_id, [*facts, *drop])
        if not facts:
            return
        layout, fresh = fresh_user_file(user_id, facts, records, embeddings)
        with self._writer():
            current = self._clean(user_id)
            check_layout(user_id, facts, current.layout.kept_as(layout.at_rest) if current else None)
            self._commit(user_id, current, fresh, set(facts) | set(drop))

    def delete(self, user_id: str, fact_ids: Sequence[str] | None = None) -> None:
        """Idempotent. Deleting a whole user removes their files even if they are corrupt."""
        check_ids(user_id, ())
        with self._writer():
            if fact_ids is None:
                self._remove_user(user_id)
                return
            current = self._clean(user_id)
            drop = set(fact_ids) & set(current.facts if current else ())
            if drop:
                self._commit(user_id, current, kvfile.UserFile(current.layout, {}), drop)

    def users(self) -> list[str]:
        """Users with an index or a format 1/2 file (temp and lock files are never mistaken for one)."""
        users_dir = self.root / USERS_DIR
        found = {d.name for d in users_dir.iterdir() if (d / INDEX_NAME).is_file()} if users_dir.is_dir() else set()
        found |= {p.name[: -len(SUFFIX)] for p in self.root.iterdir() if p.name.endswith(SUFFIX) and p.is_file()}
        names = (user_from_file_stem(stem) for stem in found)
        return sorted(name for name in names if nfc_names.renamed(name) is None)  # another form: not reachable

    def epoch(self, user_id: str) -> str | None:
        """The user's epoch: a random id renewed on every write (None: no such user)."""
        index = self._index(user_id)
        return index.epoch if index else None

    # -- beyond the interface --------------------------------------------------

    def embeddings(self, user_id: str) -> tuple[list[str], torch.Tensor]:
        """The fact_ids with an embedding and their vectors (``[n, dim]`` float32),
        read without the K/V (see :func:`kvfile.read_embeddings`)."""
        try:
            vectors = self._retrying(user_id, self._read_embeddings)
        except UnknownUserError:
            return [], torch.empty(0, 0)
        ids = list(vectors)
        return (ids, torch.stack([vectors[f] for f in ids])) if ids else ([], torch.empty(0, 0))

    def sweep(self) -> list[str]:
        """Remove what interrupted writes left, for every user (a server does this once as it
        starts): temp files, segments no index lists, directories with no index (a first write
        that never committed). The next write to a user would; this does it for users no one
        writes to again. Returns the users' directories that held some; corrupt indexes are left
        alone (reading them raises, as it should)."""
        users_dir = self.root / USERS_DIR
        swept = []
        with self._writer():
            for directory in sorted(users_dir.iterdir()) if users_dir.is_dir() else []:
                user_id = user_from_file_stem(directory.name)
                with contextlib.suppress(ValueError, CorruptDataError):  # not a user's directory; a corrupt index
                    before = set(directory.iterdir())
                    if self._clean(user_id) is None:
                        directory.rmdir()
                    if not directory.is_dir() or set(directory.iterdir()) != before:
                        swept.append(directory.name)
        return swept

    def user_dir(self, user_id: str) -> Path:
        """The user's directory (format 3)."""
        check_ids(user_id, ())
        return self.root / USERS_DIR / user_file_stem(user_id)

    def legacy_path(self, user_id: str) -> Path:
        """Where a format 1/2 file of the user would be."""
        check_ids(user_id, ())
        return self.root / f"{user_file_stem(user_id)}{SUFFIX}"

    # -- reading ---------------------------------------------------------------

    def _read(self, user_id: str, fact_ids: Sequence[str] | None) -> tuple[UserIndex, kvfile.UserFile]:
        """The index and the verified facts of the segments holding ``fact_ids`` (None: all)."""
        def read(index: UserIndex):
            wanted = list(index.facts) if fact_ids is None else fact_ids
            require_facts(user_id, wanted, index.facts)
            names = dict.fromkeys(index.facts[f].segment for f in wanted)
            return index, read_segments(index, {n: self._segment_path(index, n) for n in names})

        return self._retrying(user_id, read)

    def _read_embeddings(self, index: UserIndex) -> dict[str, torch.Tensor]:
        vectors: dict[str, torch.Tensor] = {}
        for name in index.segments:
            vectors.update(kvfile.read_embeddings(str(self._segment_path(index, name)), index.user_id))
        return {f: vectors[f] for f in index.facts if f in vectors}

    def _retrying(self, user_id: str, read: Callable[[UserIndex], Any]) -> Any:
        """``read(index)``, again with the new index when a writer removed a segment meanwhile."""
        for _ in range(READ_ATTEMPTS):
            with contextlib.suppress(FileNotFoundError):
                return read(self._require_index(user_id))
        raise CorruptDataError(f"{self.user_dir(user_id)}: a segment the index lists is missing")

    def _index(self, user_id: str) -> UserIndex | None:
        """The user's index (format 3, else a format 1/2 file's), cached while the file is unchanged."""
        current, legacy_file = self._index_paths(user_id)
        return (self._indexes.read(current, user_id, _read_index)
                or self._indexes.read(legacy_file, user_id, legacy.read_index)
                or self._indexes.read(current, user_id, _read_index))  # converted meanwhile

    def _index_paths(self, user_id: str) -> tuple[str, str]:
        if not isinstance(user_id, str):  # not remembered (maybe unhashable): raises the error for a bad id
            return self._paths_of_index(user_id)
        return self._remembered_paths(user_id)

    def _paths_of_index(self, user_id: str) -> tuple[str, str]:
        return str(self.user_dir(user_id) / INDEX_NAME), str(self.legacy_path(user_id))

    def _segment_path(self, index: UserIndex, name: str) -> Path:
        return self.legacy_path(index.user_id) if index.legacy else self.user_dir(index.user_id) / name


def _read_index(path: Path, user_id: str) -> UserIndex:
    return UserIndex.decode(path.read_bytes(), user_id, str(path))
